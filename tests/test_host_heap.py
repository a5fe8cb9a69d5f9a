"""A prompt's memory is mapped once and reused: moefit's heap settings (moefit/host_heap.py) and the
native layer call's kept scratch (kernels/scratch.h). Page faults are counted (getrusage), so each
test fails where the memory goes back to the kernel between uses."""

from __future__ import annotations

import os
import resource
import subprocess
import sys

import pytest
import torch

from moefit import host_heap, kernels

# A prompt chunk's pattern on the engine thread: tensors of 1 to 30 MiB made and dropped, each round.
CHUNKS = r"""
import os, resource, sys, threading
import moefit, torch

def chunks(out):
    for round in range(6):
        if round == 3:
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        held = [torch.ones(mib << 18) for mib in (24, 3, 16, 8, 30, 1, 12, 20)]
        del held
    out.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)

out = []
engine = threading.Thread(target=chunks, args=(out,))
engine.start()
engine.join()
print(moefit.HEAP_KEPT, out[0])
"""

glibc_only = pytest.mark.skipif(not host_heap.glibc(), reason="the settings are glibc's")


def chunk_faults(**env) -> tuple[bool, int]:
    """(whether moefit kept freed memory, page faults of three chunks after three warm ones) in a fresh process"""
    run = subprocess.run([sys.executable, "-c", CHUNKS], capture_output=True, text=True, check=True,
                         env={k: v for k, v in os.environ.items() if k != "MOEFIT_HEAP"} | env)
    kept, faults = run.stdout.split()
    return kept == "True", int(faults)


@glibc_only
def test_a_prompts_tensors_reuse_their_pages_after_the_first_chunks():
    kept, faults = chunk_faults()
    assert kept
    assert faults < 2_000                              # three chunks of 114 MiB: 87,000 pages
    glibc_kept, glibc_faults = chunk_faults(MOEFIT_HEAP="default")
    assert not glibc_kept and glibc_faults > 10 * max(faults, 1_000)      # what the settings save


@glibc_only
def test_the_users_own_malloc_settings_are_left_alone():
    assert chunk_faults(MALLOC_ARENA_MAX="4")[0] is False
    assert chunk_faults(GLIBC_TUNABLES="glibc.malloc.trim_threshold=0")[0] is False


@pytest.mark.skipif(kernels.library() is None, reason="no native library")
def test_a_prompt_sized_layer_call_reuses_its_scratch():
    """512 tokens to each of 8 experts at hidden 2048: 32 MiB of down outputs alone, which glibc
    maps and unmaps per call whatever its settings; kept, the third call faults in next to nothing."""
    from test_kernels import make
    x, experts, _, _ = make("int8", 2048, 32, 8, 512, seed=3)
    rows, weights = [torch.arange(512)] * 8, [torch.full((512,), 0.125)] * 8
    first = kernels.moe_layer(x, "int8", experts, rows, weights)
    kernels.moe_layer(x, "int8", experts, rows, weights)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    third = kernels.moe_layer(x, "int8", experts, rows, weights)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert torch.equal(first, third)
    assert faults < 2_000, f"{faults} page faults: the scratch (>= 40 MiB, 10,000 pages) was mapped again"

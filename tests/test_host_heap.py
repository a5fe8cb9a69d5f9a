"""A prompt's memory is mapped once and reused: moefit's heap settings (moefit/host_heap.py), made at
import, and the native layer call's kept scratch (kernels/scratch.h), whose page faults are counted
(getrusage): that test fails where the scratch goes back to the kernel between calls."""

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
    for round in range(10):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        held = [torch.ones(mib << 18) for mib in (24, 3, 16, 8, 30, 1, 12, 20)]
        del held
        out.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)

out = []
engine = threading.Thread(target=chunks, args=(out,))
engine.start()
engine.join()
print(moefit.HEAP_KEPT, *out)
"""

glibc_only = pytest.mark.skipif(not host_heap.glibc(), reason="the settings are glibc's")


def chunk_faults(**env) -> tuple[bool, list[int]]:
    """(whether moefit kept freed memory, page faults of each of ten chunks) in a fresh process"""
    run = subprocess.run([sys.executable, "-c", CHUNKS], capture_output=True, text=True, check=True,
                         env={k: v for k, v in os.environ.items() if k != "MOEFIT_HEAP"} | env)
    kept, *faults = run.stdout.split()
    return kept == "True", [int(f) for f in faults]


@glibc_only
def test_the_heap_settings_are_made_at_import():
    """glibc accepted all three (mallopt's 1 each). Whether a prompt then faults less is measured, not
    asserted: bench/prompt_heap.py (62,000-255,000 faults a 512-token prompt with glibc's defaults,
    0-10,000 kept). A synthetic pattern here did not separate the two reliably: glibc's defaults
    settle on a repeated one too, and where the main heap cannot grow in place (the address layout
    differs each run) the kept heap also maps a block anew, 1 run in 4 or 5."""
    kept, faults = chunk_faults()
    assert kept and len(faults) == 10
    assert chunk_faults(MOEFIT_HEAP="default")[0] is False


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

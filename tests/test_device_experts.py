"""The fused resident-expert kernel (kernels/device_experts.py, Triton), run on the CPU by
Triton's interpreter: the same sums as experts/grouped.py's torch path and the host's call, in
fewer operations. Skipped where Triton is not installed (it is in the test extras)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

HERE = Path(__file__).resolve().parent


def test_the_fused_kernel_multiplies_as_the_torch_path_and_the_runner_takes_it(packs, card):
    """... and where it does not compile, it turns itself off with the reason and the torch path runs."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, str(HERE / "device_experts_check.py"), str(packs("qwen3_moe", "int4")),
                          str(card(64))], capture_output=True, text=True, timeout=600, env=env, cwd=HERE.parent)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert set(result["kernel"]) == {"int4/32", "int4/64", "q8_0/32", "int8/0"}
    assert max(result["kernel"].values()) < 1e-5, result
    runner = result["runner"]
    assert runner["fused_vs_torch"] < 1e-5, runner
    assert runner["fused_vs_host"] < 0.02, runner                  # the host rounds activations to 8 bits
    assert runner["ops_fused"] * 2 < runner["ops_torch"], runner
    assert result["fallback"] == {"same_as_torch": True, "warned": 1, "usable_after": False,
                                  "broken": "RuntimeError: CompilationError: an unsupported construct"}

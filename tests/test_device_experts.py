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


@pytest.mark.parametrize("capability", [89, 90])                    # an RTX 4070 (sm_89), an H100 / H200 (sm_90)
def test_the_fused_kernel_compiles_to_a_cubin_for_the_gpus_it_is_for(capability):
    """Triton compiles ahead of time without a GPU (ptxas comes in its wheel): every kind of
    matrix, both input dtypes, the row counts it is launched with. The interpreter test checks
    the arithmetic; this one that the compiled form exists (not that it is fast)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from moefit.kernels import triton_matvec
    fn = triton_matvec._grouped_matvec
    codes = {0: ("*u8", "*fp16", (32, 64)), 1: ("*i8", "*fp16", (32,)), 2: ("*i8", "*fp32", (32,))}
    made = 0
    for kind, (code_type, scale_type, groups) in codes.items():
        for x_type in ("*bf16", "*fp32"):
            for group in groups:
                for rows in (2, 4):
                    const = {"GROUP": group, "KIND": kind, "TP": rows, "BLOCK_R": 32}
                    signature = {"x_ptr": x_type, "w_ptr": code_type, "s_ptr": scale_type, "out_ptr": "*fp32"}
                    signature.update({n: "i32" for n in fn.arg_names[4:15]})
                    signature.update({n: "constexpr" for n in const})
                    source = ASTSource(fn=fn, signature=signature,
                                       constexprs={(fn.arg_names.index(k),): v for k, v in const.items()})
                    kernel = compile(source, target=GPUTarget("cuda", capability, 32))
                    assert kernel.asm["cubin"] and ".entry _grouped_matvec" in kernel.asm["ptx"]
                    made += 1
    assert made == 16

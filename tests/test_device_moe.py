"""The slot-table expert kernels (kernels/device_moe.py, Triton), run on the CPU by Triton's
interpreter over a simulated card's pool: each expert's SwiGLU from its slot, the runner
queuing them before the hand-off's wait, the same greedy tokens as without them; and compiled
ahead of time for the GPUs they are for. Skipped where Triton is not installed (it is in the
test extras)."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

HERE = Path(__file__).resolve().parent


def test_the_slot_table_kernels_sum_the_resident_experts_and_the_runner_takes_them(packs, card):
    env = dict(os.environ, TRITON_INTERPRET="1")
    paths = [str(packs("qwen3_moe", "int4")), str(packs("mixtral", "q8_0")), str(packs("olmoe", "int8"))]
    run = subprocess.run([sys.executable, str(HERE / "device_moe_check.py"), str(card(64)), *paths],
                         capture_output=True, text=True, timeout=600, env=env, cwd=HERE.parent)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(result["kernel"]) == 3 and max(result["kernel"].values()) < 1e-5, result   # int4, Q8_0, int8
    greedy = result["greedy"]
    assert greedy["same_tokens"] and greedy["same_handoffs"], greedy
    assert greedy["fused_steps"] == 24 and greedy["fused_steps_off"] == 0, greedy   # 12 steps x 2 MoE layers
    assert greedy["swaps"] > 0 and greedy["rows_sent"] > 2, greedy                   # rows went down again
    assert greedy["pieces_same_tokens"] and greedy["pieces_same_handoffs"], greedy      # between recorded pieces
    assert greedy["pieces_fused_steps"] == 24 and greedy["pieces_replays"] > 0, greedy
    assert result["run"] < 0.02, result                # the host rounds activations to 8 bits; the kernels do not
    assert result["ops"]["fused"] * 2 < result["ops"]["grouped"], result       # 10 against 33 when written
    full = result["all_resident"]
    assert all(full["same"].values()), full
    assert full["handoffs_off"] == full["forwards"] * full["layers"], full          # one wait a layer ...
    assert full["handoffs"] <= full["forwards"] + 1, full                          # ... against one a forward


def test_the_slot_table_kernels_read_a_gguf_files_super_blocks(tmp_path, card):
    """IQ4_XS, Q5_K_M-style (Q5_K gate and up, Q6_K down) and Q4_K_M-style (Q4_K, Q6_K) experts as
    the file stores them (every super-block kind, each a matrix of a kind the kernels take): each resident expert's SwiGLU against its weights dequantised in fp32;
    for the Q4_K_M one, the same greedy tokens with the kernels as without them (between recorded
    pieces: the int4 pack's test above)."""
    gguf = pytest.importorskip("gguf")
    import tiny
    from gguf_writer import write_gguf
    from moefit.pack.convert import convert
    hf = tiny.build_checkpoint("qwen3_moe", tmp_path / "hf", mlp_only_layers=[], hidden_size=256,
                               moe_intermediate_size=256, intermediate_size=256)
    t, paths = gguf.GGMLQuantizationType, []
    for name, experts, down in (("iq4_xs", t.IQ4_XS, None), ("q5_k_m", t.Q5_K, t.Q6_K), ("q4_k_m", t.Q4_K, t.Q6_K)):
        convert(write_gguf(hf, tmp_path / f"{name}.gguf", "qwen3_moe", experts, down), tmp_path / name, progress=False)
        paths.append(str(tmp_path / name))
    run = subprocess.run([sys.executable, str(HERE / "device_moe_check.py"), "--super-blocks", str(card(64)), *paths],
                         capture_output=True, text=True, timeout=900, env=dict(os.environ, TRITON_INTERPRET="1"),
                         cwd=HERE.parent)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert set(result["kernel"]) == {"iq4_xs", "q5_k_m", "q4_k_m"} and max(result["kernel"].values()) < 1e-5, result
    greedy = result["greedy"]["q4_k_m"]
    assert greedy["same_tokens"] and greedy["same_handoffs"], greedy
    assert greedy["fused_steps"] > 0 and greedy["fused_steps_off"] == 0, greedy


def test_the_slot_table_kernels_run_gpt_oss_experts(packs, tmp_path, card):
    """gpt-oss's own expert function (biases, a clamped gate) in the kernels, for its experts packed
    as int4 and as a GGUF file's MXFP4 blocks: each resident expert against the model card's
    function on its weights dequantised in fp32; for the MXFP4 file, the same greedy tokens as its
    grouped path's (its attention is not recorded in decode graphs yet: those runs are eager)."""
    gguf = pytest.importorskip("gguf")
    import tiny
    from gguf_writer import write_gguf
    from moefit.pack.convert import convert
    hf = tiny.build_checkpoint("gpt_oss", tmp_path / "hf")
    convert(write_gguf(hf, tmp_path / "mxfp4.gguf", "gpt_oss", gguf.GGMLQuantizationType.MXFP4), tmp_path / "mxfp4",
            "keep", progress=False)
    paths = [str(packs("gpt_oss", "int4")), str(tmp_path / "mxfp4")]
    run = subprocess.run([sys.executable, str(HERE / "device_moe_check.py"), "--super-blocks", str(card(64)), *paths],
                         capture_output=True, text=True, timeout=900, env=dict(os.environ, TRITON_INTERPRET="1"),
                         cwd=HERE.parent)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(result["kernel"]) == 2 and max(result["kernel"].values()) < 1e-5, result
    greedy = result["greedy"]["mxfp4"]
    assert greedy["same_tokens"] and greedy["same_handoffs"] and greedy["fused_steps"] == 12, greedy   # 4 x 3 layers


def test_the_device_checks_kernel_check_builds_its_packs_and_measures_them(tmp_path, card):
    """bench/gpu_kernels.py, the device check's look at the kernels on a card, here under the
    interpreter for one case (gpt-oss's experts as random MXFP4 blocks, bench/synthetic_pack.py),
    so that what it builds and compares is known to work before a GPU runs all of its cases."""
    root = HERE.parent
    run = subprocess.run([sys.executable, str(root / "bench" / "gpu_kernels.py"), "--device", f"sim:{card(64)}",
                          "--case", "gpt-oss-20b mxfp4", "--width", "256", "--workdir", str(tmp_path)],
                         capture_output=True, text=True, timeout=600, env=dict(os.environ, TRITON_INTERPRET="1"))
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["ok"] and list(result["errors"]) == ["gpt-oss-20b mxfp4"] and result["worst"] < 1e-5, result


@pytest.mark.parametrize("capability", [89, 90])                    # an RTX 4070 (sm_89), an H100 / H200 (sm_90)
def test_the_slot_table_kernels_compile_to_a_cubin_for_the_gpus_they_are_for(capability):
    """The interpreter checks the arithmetic and lets through what the compiler would not (a
    pointer cast, a branch on a loaded value): this compiles both kernels for every kind of
    matrix (int4, Q8_0, int8; Q4_K, Q5_K, Q6_K and IQ4_XS super-blocks, MXFP4 blocks), both input
    dtypes and both expert functions (SwiGLU, gpt-oss's), as they are launched."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from moefit.kernels import triton_moe
    made = 0
    for kind, x_type, act in itertools.product((0, 1, 2, 3, 4, 5, 6, 7), ("*bf16", "*fp32"), (0, 1)):
        bias = x_type if act else "*u8"                  # gpt-oss's biases in the compute dtype; else the base
        for fn, pointers, ints, floats, const in (
                (triton_moe._gate_up_act, {"x_ptr": x_type, "ids_ptr": "*i64", "table_ptr": "*i64", "base_ptr": "*u8",
                                           "base_addr": "i64", "h_ptr": "*fp32", "bias_ptr": bias},
                 ("T", "K", "I", "C", "sxt"), ("alpha", "limit"),
                 {"GROUP": 32, "KIND": kind, "ACT": act, "TP": 2, "KP": 8, "BLOCK": 32}),
                (triton_moe._down_sum, {"h_ptr": "*fp32", "ids_ptr": "*i64", "w_ptr": "*fp32", "table_ptr": "*i64",
                                        "base_ptr": "*u8", "base_addr": "i64", "out_ptr": "*fp32", "bias_ptr": bias},
                 ("K", "I", "E"), (), {"GROUP": 32, "KIND": kind, "ACT": act, "BLOCK": 32})):
            signature = dict(pointers)
            signature.update({n: "i32" for n in ints + ("gu_at", "gu_scale_at", "down_at", "down_scale_at")})
            signature.update({n: "fp32" for n in floats})
            signature.update({n: "constexpr" for n in const})
            source = ASTSource(fn=fn, signature=signature,
                               constexprs={(fn.arg_names.index(k),): v for k, v in const.items()})
            kernel = compile(source, target=GPUTarget("cuda", capability, 32))
            assert kernel.asm["cubin"] and f".entry {fn.__name__}" in kernel.asm["ptx"]
            made += 1
    assert made == 64

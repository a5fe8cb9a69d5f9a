"""The device check's look at the slot-table kernels (kernels/device_moe.py) on the card itself.

Every kind of expert matrix they read (moefit's int4, Q8_0 and int8; a GGUF file's Q4_K, Q5_K,
Q6_K and IQ4_XS super-blocks, Q4_K_M's and Q5_K_M's mixes, MXFP4 blocks) and both expert
functions (SwiGLU; gpt-oss's biased, clamped one): each resident expert's output against its
weights dequantised in fp32 on the same device. Triton's interpreter checks the same arithmetic
in the tests (tests/device_moe_check.py, which shares `kernel_error`); this is for what a
compiler and a GPU may do differently (a fast exp, fused multiply-adds, the order of sums, a
constant that does not fit). The packs are small and random, one layer of Qwen3-30B-A3B's and
gpt-oss-20b's architectures (bench/synthetic_pack.py), built in seconds without a checkpoint.

    python bench/gpu_kernels.py [--device cuda] [--case "gpt-oss-20b mxfp4"] [--width 256]
    TRITON_INTERPRET=1 python bench/gpu_kernels.py --device sim:CARD ...    # the same on the CPU, slowly
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.synthetic_pack import build_pack  # noqa: E402
from moefit.config import ServeConfig  # noqa: E402
from moefit.kernels import device_moe  # noqa: E402
from moefit.pack.quant import TORCH_DTYPES, dequantize  # noqa: E402
from moefit.runtime.engine import Engine  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CASES = [("qwen3-30b-a3b", q) for q in ("int4", "q8_0", "int8", "q4_k", "iq4_xs", "q4_k/q6_k", "q5_k/q6_k")] + [
    ("gpt-oss-20b", "int4"), ("gpt-oss-20b", "mxfp4")]
GOAL = 1e-5                  # the worst relative difference from fp32 (the interpreter: 1.5e-7 to 7.5e-7)
WIDTHS = ("hidden_size", "intermediate_size", "moe_intermediate_size")
SMALL = {"hidden_size": 512, "intermediate_size": 512, "moe_intermediate_size": 512, "num_experts": 8,
         "num_local_experts": 8, "vocab_size": 1024, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 64, "eos_token_id": 1, "pad_token_id": 0, "bos_token_id": 0}


def check_kernels(device: str, pack=None, cases=CASES, workdir: str | None = None, width: int = 512) -> dict:
    """Each case's worst relative difference; ok when all are within GOAL, None (skipped) where
    the kernels do not run here (no Triton, or a simulated card without the interpreter)."""
    if not device_moe.usable(torch.empty(0, device="cuda" if device.startswith("cuda") else "cpu")):
        return {"ok": None, "skipped": "needs CUDA and Triton (or Triton's interpreter, TRITON_INTERPRET=1)"}
    work = Path(workdir or tempfile.mkdtemp())
    errors = {}
    for family, quant in cases:
        engine = open_all_resident(small_pack(family, quant, work, width), device)
        errors[f"{family} {quant}"] = kernel_error(engine)
    worst = max(errors.values())
    return {"ok": worst < GOAL and device_moe.broken is None, "worst": worst, "goal": GOAL, "errors": errors,
            "broken": device_moe.broken}


def small_pack(config: str, quant: str, work: Path, width: int = 512, layers: int = 1, **over) -> Path:
    """The first `layers` random layers of the config's architecture, small (SMALL; hidden and
    expert size `width`, a multiple of 256; `over` sets more of the config), experts in `quant`."""
    raw = json.loads((ROOT / "configs" / f"{config}.json").read_text())
    raw.pop("quantization_config", None)
    text = raw.get("text_config", raw)
    text.update({k: width if k in WIDTHS else v for k, v in SMALL.items() if k in text})
    text.update(over)
    name = f"{config}-{width}-{layers}" + "".join(f"-{k}{v}" for k, v in sorted(over.items()))
    path = work / f"{name}.json"
    path.write_text(json.dumps(raw))
    out = work / f"{name}-{quant.replace('/', '-')}"
    return out if out.exists() else build_pack(path, out, quant, layers=layers)


def open_all_resident(pack: Path, device: str) -> Engine:
    """An engine on the device with every expert in its cache."""
    flags = dict(vram_reserve_mib=1, low_headroom_mib=0) if device.startswith("sim:") else {}
    return Engine.open(pack, ServeConfig(device=device, ctx=64, min_expert_slots=0,
                                         expert_cache=str(SMALL["num_experts"]), **flags))     # one layer's


def kernel_error(engine: Engine) -> float:
    """The worst relative difference over 1, 3 and 6 token rows (two launches of gate_up; the 6
    rows larger, so that gpt-oss's gates and ups reach its clamp), two of the last MoE layer's
    experts off the card, between the kernels and `reference`."""
    runner, m = engine.runner, engine.pack.model
    layer = m.moe_layers[-1]
    for e in (1, 4):
        runner.unload((layer, e))
    quant = runner.pack.blobs[(layer, 0)].quant
    shape = device_moe.blob_shape(runner.pack.layouts[quant], quant)
    act = runner.fused.act(layer) if runner.fused.act is not None else None
    device, dtype = runner.table.base.device, TORCH_DTYPES[engine.loaded.compute_dtype]
    gen, worst = torch.Generator().manual_seed(2), 0.0
    for tokens in (1, 3, 6):
        x = (torch.randn(tokens, m.hidden_size, generator=gen) * (8 if tokens == 6 else 1)).to(device, dtype)
        ids = torch.stack([torch.randperm(m.num_experts, generator=gen)[:m.top_k] for _ in range(tokens)])
        ids[0, 0] = 1                                          # a rank whose expert is not resident
        weights = torch.rand(tokens, m.top_k, generator=gen)
        ids, weights = ids.to(device), weights.to(device)
        got = device_moe.resident_sum(x, ids, weights, runner.table.row(layer), runner.table.base, shape, act)
        if got is None:                                        # did not compile: device_moe.broken says why
            return float("inf")
        want = reference(runner, layer, x, ids, weights)
        worst = max(worst, float((got - want).abs().max() / want.abs().max()))
    return worst


def reference(runner, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The resident experts' weighted expert function in fp32 from dequantised weights, rank by rank."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        for r, e in enumerate(ids[t].tolist()):
            parts = runner.slots.get((layer, e))
            if parts is not None:
                out[t] += weights[t, r] * expert(runner, layer, e, x[t].float(), parts)
    return out


def expert(runner, layer: int, e: int, x: torch.Tensor, parts: dict) -> torch.Tensor:
    """SwiGLU, or gpt-oss's biased and clamped expert as its model card writes it, in fp32."""
    quant = runner.pack.blobs[(layer, e)].quant
    gate, up = F.linear(x, dequantize(parts, "gate_up", quant, torch.float32)).chunk(2)
    if runner.fused.act is None:
        return F.linear(F.silu(gate) * up, dequantize(parts, "down", quant, torch.float32))
    act = runner.fused.act(layer)
    bias = act.gate_up_bias[e].float()
    gate = (gate + bias[:gate.shape[0]]).clamp(max=act.limit)
    up = (up + bias[gate.shape[0]:]).clamp(-act.limit, act.limit)
    h = gate * torch.sigmoid(act.alpha * gate) * (up + 1)
    return F.linear(h, dequantize(parts, "down", quant, torch.float32)) + act.down_bias[e].float()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--case", action="append", help='"CONFIG QUANT" (configs/CONFIG.json); default: all of CASES')
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--workdir", help="where the small packs are built (kept)")
    args = ap.parse_args()
    cases = [tuple(c.split()) for c in args.case] if args.case else CASES
    print(json.dumps(check_kernels(args.device, cases=cases, workdir=args.workdir, width=args.width)))


if __name__ == "__main__":
    main()

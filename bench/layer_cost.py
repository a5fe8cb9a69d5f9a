"""What a decode step's layer costs beyond reading its weights: tiny random checkpoints (hidden 64,
head_dim 32, 8 experts top-2) with as many layers as a real model (48: Qwen3-30B-A3B, Qwen3.5-35B's
40), decoded greedily with the dense matrices quantised (--dense-quant int4), so that every layer
goes through the native calls a real model's does and the weights themselves take no time. The
per-layer figure is the Python, torch and ctypes work between the kernels; a real model's decode
step pays it once per layer on top of its bandwidth. Not a test.

    .venv/bin/python bench/layer_cost.py [--families qwen3_moe qwen3_5_moe] [--layers 48] [--threads 2]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def build(family: str, layers: int, work: Path) -> Path:
    import tiny
    out = work / f"{family}-{layers}"
    if (out / "pack" / "moefit-pack.json").exists():
        return out / "pack"
    over = dict(num_hidden_layers=layers, head_dim=32)    # the native steps take head dims of 16s
    if family == "qwen3_moe":
        over["mlp_only_layers"] = []
    if family in ("glm4_moe_lite", "deepseek_v3"):
        over.update(qk_rope_head_dim=16, kv_lora_rank=32, q_lora_rank=64, qk_nope_head_dim=32,
                    v_head_dim=32)                                                       # dims kernels/mla.h takes
    if family == "glm4_moe_lite":
        over["mlp_layer_types"] = ["dense"] + ["sparse"] * (layers - 1)
    if family == "gpt_oss":
        over["layer_types"] = ["sliding_attention", "full_attention"] * (layers // 2)
    if family == "qwen3_5_moe":
        over["layer_types"] = (["linear_attention"] * 3 + ["full_attention"]) * (layers // 4)
    tiny.build_checkpoint(family, out / "hf", **over)
    subprocess.run([sys.executable, "-m", "moefit", "pack", str(out / "hf"), "-o", str(out / "pack"), "--quant",
                    "int4"], check=True, capture_output=True)
    return out / "pack"


def decode_rate(pack: Path, threads: int, new: int, repeats: int, kv_dtype: str = "auto") -> float:
    from moefit.config import ServeConfig
    from moefit.runtime.engine import Engine
    from moefit.runtime.sampler import SamplingParams
    engine = Engine.open(pack, ServeConfig(ctx=new + 64, dense_quant="int4", threads=threads, kv_dtype=kv_dtype))
    prompt = list(range(3, 19))
    engine.generate(prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    best = 0.0
    for _ in range(repeats):
        engine.kv_tokens = []
        _, stats, _ = engine.generate(prompt, SamplingParams(max_tokens=new, ignore_eos=True, temperature=0))
        best = max(best, stats.decode_tokens_per_s)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", nargs="+", default=["qwen3_moe", "qwen3_5_moe"])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--kv-dtype", default="auto", help="the KV cache's dtype (ServeConfig.kv_dtype)")
    ap.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "moefit-bench-layer-cost"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"# bench/layer_cost.py: {args.layers} layers, hidden 64, fp32 activations, dense int4, "
          f"{args.threads} threads, {args.new} new tokens greedy, best of {args.repeats}, KV {args.kv_dtype}, "
          f"torch {torch.__version__}")
    for family in args.families:
        pack = build(family, args.layers, Path(args.work))
        rate = decode_rate(pack, args.threads, args.new, args.repeats, args.kv_dtype)
        print(f"{family:12s} {rate:7.1f} tok/s  {1e6 / rate / args.layers:5.0f} us a layer")


if __name__ == "__main__":
    main()

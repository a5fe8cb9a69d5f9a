"""Decode on a hybrid (Gated DeltaNet) model: the DeltaNet layers' one-call step (kernels/delta.h)
against the same layers op by op, in one script. Not a test.

    .venv/bin/python bench/hybrid_decode.py [--layers 8] [--new 24] [--pack /tmp/q36.pack]

A Qwen3.6-35B-A3B-shaped pack (its first --layers layers: 3 DeltaNet + 1 attention per 4, all 256
experts of 512, hidden 2048), random int4 experts, dense int4 (--dense-quant), on this machine's
host. The two ways alternate, best of --repeats each; the figure per DeltaNet layer is what the
model's 30 such layers would save a token.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.synthetic_pack import build_pack  # noqa: E402
from moefit import kernels  # noqa: E402
from moefit.config import ServeConfig  # noqa: E402
from moefit.models.qwen3_5_moe import Qwen3_5Moe  # noqa: E402
from moefit.runtime.engine import Engine  # noqa: E402


def decode_ms(engine: Engine, prompt: list[int], new: int) -> float:
    """ms a token over `new` greedy-free decode steps (a fixed token stream: the same work either way)."""
    engine.kv_tokens = []
    engine.prefill(prompt)
    t0 = time.perf_counter()
    for i in range(new):
        engine.decode_step(100 + 7 * i, len(prompt) + i)
    return (time.perf_counter() - t0) / new * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--new", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dense-quant", default="int4")
    ap.add_argument("--pack", default="/tmp/moefit-bench-hybrid/q36.pack")
    args = ap.parse_args()
    pack = Path(args.pack)
    if not (pack / "moefit-pack.json").exists():
        build_pack(ROOT / "configs" / "qwen3.6-35b-a3b.json", pack, "int4", layers=args.layers, distinct=64)
    engine = Engine.open(pack, ServeConfig(ctx=1024, dense_quant=args.dense_quant))
    model = engine.model
    linear = sum("linear" in layer for layer in model.layers)
    prompt = list(range(100, 164))
    native_step = Qwen3_5Moe.delta_steps
    best = {"native": float("inf"), "op by op": float("inf")}
    for _ in range(args.repeats):
        for way in best:
            Qwen3_5Moe.delta_steps = native_step if way == "native" else (lambda *a: None)
            best[way] = min(best[way], decode_ms(engine, prompt, args.new))
    Qwen3_5Moe.delta_steps = native_step
    saved = (best["op by op"] - best["native"]) / linear
    print(f"# bench/hybrid_decode.py: Qwen3.6-35B-A3B shape, first {len(model.layers)} layers ({linear} DeltaNet), "
          f"int4 experts, dense {args.dense_quant}, prompt {len(prompt)}, {args.new} tokens, best of {args.repeats}, "
          f"{kernels.default_threads()} threads, torch {torch.__version__}, {platform.machine()}")
    for way, ms in best.items():
        print(f"DeltaNet {way:<9} {ms:7.1f} ms a token  {1e3 / ms:6.1f} tok/s  {best['op by op'] / ms:5.2f}x")
    print(f"saved {saved:.2f} ms a DeltaNet layer a token: {30 * saved:.0f} ms a token over Qwen3.6's 30")


if __name__ == "__main__":
    main()

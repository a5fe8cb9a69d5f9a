"""MLA's kv_b held head by head and quantised under --dense-quant (models/deepseek_v3.py) against
its slices kept in fp32 (two per-head torch products a layer; the only way before round 20, which
absorbed them into q_b and o_proj instead, round 21 replacing that), in one process, alternating.
Not a test.

    .venv/bin/python bench/mla_checkpoint.py /tmp/flash12/hf --layers 12 --experts 4
    .venv/bin/python -m moefit pack /tmp/flash12/hf -o /tmp/flash12/pack --quant int4
    .venv/bin/python bench/mla_per_head.py /tmp/flash12/pack [--rounds 3] [--threads 2]

Served --dense-quant int4 --kv-dtype int8; prompt 128, 32 new tokens at temperature 2 (spread
routing, as bench/decode.py), after a warm-up on the whole prompt. "slices" sets
models.deepseek_v3.per_head to answer False.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import moefit.models.deepseek_v3 as mla  # noqa: E402
from moefit.config import ServeConfig  # noqa: E402
from moefit.runtime.engine import Engine  # noqa: E402
from moefit.runtime.sampler import SamplingParams  # noqa: E402


def rates(pack: Path, prompt: list[int], threads: int) -> tuple[float, float]:
    engine = Engine.open(pack, ServeConfig(ctx=256, dense_quant="int4", kv_dtype="int8", threads=threads))
    engine.generate(prompt, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    engine.kv_tokens = []
    spread = SamplingParams(max_tokens=32, ignore_eos=True, temperature=2.0, top_k=0, top_p=1.0, seed=7)
    _, stats, _ = engine.generate(prompt, spread)
    return stats.prefill_tokens_per_s, stats.decode_tokens_per_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pack", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    prompt = torch.randint(100, 30000, (128,), generator=torch.Generator().manual_seed(0)).tolist()
    per_head, best = mla.per_head, {"per head": (0.0, 0.0), "slices": (0.0, 0.0)}
    for rnd in range(args.rounds):
        for name in best:
            mla.per_head = per_head if name == "per head" else (lambda m, quant: False)
            prefill, decode = rates(args.pack, prompt, args.threads)
            best[name] = (max(best[name][0], prefill), max(best[name][1], decode))
            print(f"{rnd} {name:8} prefill {prefill:6.1f} decode {decode:6.2f}", flush=True)
    mla.per_head = per_head
    for name, (prefill, decode) in best.items():
        print(f"{name:8} best prefill {prefill:.1f} decode {decode:.2f} tok/s "
              f"({decode / best['slices'][1]:.2f}x the slices' decode)")


if __name__ == "__main__":
    main()

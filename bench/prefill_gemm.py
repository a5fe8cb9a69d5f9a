"""Prefill several ways, alternating in one process: as moefit runs it (each dense product of a
prompt by the way measured fastest for its shape, kernels/gemm.py; busy experts as GEMMs from the
measured crossover, --expert-gemm-rows auto); each dense way forced (the integer dots, MKL's or
oneDNN's fp32 GEMM on the natively dequantised matrix); busy experts from 24 rows (the threshold
the eleventh round fixed on an Intel Xeon); all integer dots. Not a test.

    .venv/bin/python bench/prefill_gemm.py PACK [--prompt 512] [--chunk 512] [--dense-quant int4] [--rounds 3]

The bench packs have 64 experts, top-8: a 512-token chunk gives an expert 64 rows on average, as
Qwen3-30B-A3B's 128 experts get at --chunk 1024 and Qwen3.6's 256 at 2048 (--chunk 256 here: 32).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moefit import kernels  # noqa: E402
from moefit.config import ServeConfig  # noqa: E402
from moefit.kernels import gemm  # noqa: E402
from moefit.runtime.engine import Engine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pack")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--dense-quant", default="int4")
    ap.add_argument("--chunk", type=int, default=512, help="prompt tokens per prefill forward")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    engine = Engine.open(Path(args.pack), ServeConfig(ctx=args.prompt + 64, dense_quant=args.dense_quant,
                                                          prefill_chunk=args.chunk))
    prompt = [(1000 + 7 * i) % engine.model.cfg.vocab_size for i in range(args.prompt)]
    engine.prefill(prompt)                   # the crossover and the dense ways measured once, outside the timing
    rows = {q: r or "never" for q, r in engine.runner.rates.reported().items()}
    chosen = gemm.chosen()
    ways = {"measured (moefit)": (None, "auto"), "dense: dots": ("dots", "auto"), "dense: MKL": ("mkl", "auto"),
            "dense: oneDNN": ("onednn", "auto"), "experts GEMM, 24": (None, "24"), "integer dots": ("dots", "off")}
    rates: dict[str, list[float]] = {way: [] for way in ways}
    for _ in range(args.rounds):
        for way, (forced, expert_rows) in ways.items():
            gemm.FORCED, engine.runner.rates.setting = forced, expert_rows
            engine.forget_prefix()
            t0 = time.perf_counter()
            engine.prefill(prompt)
            rates[way].append(args.prompt / (time.perf_counter() - t0))
    print(f"# bench/prefill_gemm.py {Path(args.pack).name}: prompt {args.prompt}, chunk {args.chunk}, "
          f"dense {args.dense_quant}, "
          f"{kernels.default_threads()} threads, torch {torch.__version__}; tok/s, best of {args.rounds}; "
          f"measured crossover (rows): {rows or 'none'}; shape classes won: {chosen}")
    base = max(rates["integer dots"])
    for way, r in rates.items():
        print(f"{way:<18} {max(r):7.1f} tok/s  {max(r) / base:5.2f}x   ({', '.join(f'{v:.1f}' for v in r)})")


if __name__ == "__main__":
    main()

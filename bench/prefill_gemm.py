"""Prefill four ways, alternating in one process: all integer dots; the dense matrices (with
--dense-quant) as fp32 GEMMs on the natively dequantised matrix (pack/quant.py, GEMM_TOKENS or more
tokens); and also each busy expert's, from the rows where that pays on this machine (the runner's
measured crossover, --expert-gemm-rows auto), or from 24 rows (the threshold the eleventh round
fixed on an Intel Xeon). Not a test.

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
from moefit.pack import quant  # noqa: E402
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
    engine.prefill(prompt[:quant.GEMM_TOKENS + 8])          # the crossover measured once, outside the timing
    rows = {q: r or "never" for q, r in engine.runner.rates.reported().items()}
    never, tokens = 10 ** 9, quant.GEMM_TOKENS
    ways = {"experts GEMM, auto": (tokens, "auto"), "experts GEMM, 24": (tokens, "24"),
            "dense GEMM": (tokens, "off"), "integer dots": (never, "off")}
    rates: dict[str, list[float]] = {way: [] for way in ways}
    for _ in range(args.rounds):
        for way, (gemm_tokens, expert_rows) in ways.items():
            quant.GEMM_TOKENS, engine.runner.rates.setting = gemm_tokens, expert_rows
            engine.forget_prefix()
            t0 = time.perf_counter()
            engine.prefill(prompt)
            rates[way].append(args.prompt / (time.perf_counter() - t0))
    print(f"# bench/prefill_gemm.py {Path(args.pack).name}: prompt {args.prompt}, chunk {args.chunk}, "
          f"dense {args.dense_quant}, "
          f"{kernels.default_threads()} threads, torch {torch.__version__}; tok/s, best of {args.rounds}; "
          f"measured crossover (rows): {rows or 'none'}")
    base = max(rates["integer dots"])
    for way, r in rates.items():
        print(f"{way:<18} {max(r):7.1f} tok/s  {max(r) / base:5.2f}x   ({', '.join(f'{v:.1f}' for v in r)})")


if __name__ == "__main__":
    main()

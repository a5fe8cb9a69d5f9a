"""The host MoE kernel alone: one layer call (top-k experts of one token) at a real expert
shape, over many distinct experts so that weights come from memory, not the cache. Not a test.

    .venv/bin/python bench/kernel.py [--hidden 2048] [--inter 768] [--experts 256] [--threads 1 2]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moefit import kernels  # noqa: E402
from moefit.pack.quant import quantize  # noqa: E402


def experts(n: int, hidden: int, inter: int, quant: str) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        p = dict(zip(["gate_up", "gate_up.scale"], quantize(torch.randn(2 * inter, hidden, generator=g), quant, 32)))
        p.update(zip(["down", "down.scale"], quantize(torch.randn(hidden, inter, generator=g), quant, 32)))
        out.append(p)
    return out


def nbytes(p: dict) -> int:
    return sum(t.nbytes for t in p.values())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()
    print(f"isa {kernels.isa()}; hidden {args.hidden}, expert {args.inter}, top-{args.top_k}, "
          f"{args.tokens} token(s), {args.experts} distinct experts")
    for quant in ("int8", "int4"):
        ex = experts(args.experts, args.hidden, args.inter, quant)
        total = sum(nbytes(p) for p in ex)
        x = torch.randn(args.tokens, args.hidden)
        rows = [torch.arange(args.tokens)] * args.top_k
        w = [torch.full((args.tokens,), 1.0 / args.top_k)] * args.top_k
        for threads in args.threads:
            kernels.set_threads(threads)
            calls = args.experts // args.top_k
            for _ in range(2):                               # warm-up pass, then the timed one
                t0 = time.perf_counter()
                for c in range(calls):
                    kernels.moe_layer(x, quant, ex[c * args.top_k:(c + 1) * args.top_k], rows, w)
                dt = time.perf_counter() - t0
            print(f"{quant} {threads} thread(s): {dt / calls * 1e3:.3f} ms a layer call, "
                  f"{total / dt / 1e9:.1f} GB/s of expert weights ({total / 2**20:.0f} MiB read)")


if __name__ == "__main__":
    main()

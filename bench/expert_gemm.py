"""One expert's rows of a prompt chunk on the host two ways: the integer dots of the native layer
call, and two fp32 GEMMs on its matrices dequantised natively (experts/groups.gemm_forward), over
many distinct experts so that weights come from memory. Prints each way's time per expert and
their ratio by row count: where the GEMM overtakes is what experts/costs.py's crossover measures at start. Not a test.

    .venv/bin/python bench/expert_gemm.py [--hidden 2048] [--inter 768] [--quants int4 q4_k/q6_k]
                                          [--rows 8 16 32 64] [--threads 2]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from kernel import experts  # noqa: E402
from moefit import kernels  # noqa: E402
from moefit.experts.groups import gemm_forward  # noqa: E402


def best_of(fn, n: int, repeats: int = 3) -> float:
    """The best of `repeats` passes over n experts (after a warm-up pass), seconds an expert."""
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        for i in range(n):
            fn(i)
        times.append((time.perf_counter() - t0) / n)
    return min(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--experts", type=int, default=48)
    ap.add_argument("--quants", nargs="+", default=["int4", "int8", "q8_0", "q4_k", "q4_k/q6_k"])
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 16, 24, 32, 48, 64, 128])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    kernels.set_threads(args.threads)
    print(f"isa {kernels.isa()}; hidden {args.hidden}, expert {args.inter}, fp32 activations, "
          f"{args.threads} thread(s) (torch's raised to them for the GEMM), {args.experts} distinct experts; "
          "ms an expert, dots / GEMM")
    for quant in args.quants:
        ex = experts(args.experts, args.hidden, args.inter, quant)
        line = []
        for rows in args.rows:
            x = torch.randn(rows, args.hidden)
            index, weight = [torch.arange(rows)], [torch.ones(rows)]
            dots = best_of(lambda i: kernels.moe_layer(x, quant, [ex[i]], index, weight), len(ex))
            with kernels.torch_threads():
                gemm = best_of(lambda i: gemm_forward(x, ex[i], quant), len(ex))
            line.append(f"{rows}: {dots * 1e3:.2f}/{gemm * 1e3:.2f} {dots / gemm:.2f}x")
        print(f"{quant:10s} " + "  ".join(line), flush=True)


if __name__ == "__main__":
    main()

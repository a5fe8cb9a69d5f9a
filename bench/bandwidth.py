"""The machine's sustained read bandwidth, 1 and N threads, on a working set far above the
last-level cache: what a bandwidth-bound decode can hope for. Not a test.

    .venv/bin/python bench/bandwidth.py [--gib 4] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch


def read_gbs(x: torch.Tensor, threads: int, repeats: int = 5) -> float:
    torch.set_num_threads(threads)
    x.sum()                                                   # warm-up: pages touched, threads up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * x.element_size() / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    x = torch.ones(int(args.gib * (1 << 30)) // 4, dtype=torch.float32)
    for n in sorted({1, args.threads}):
        print(f"read bandwidth, {n} thread{'s' if n > 1 else ''}, {args.gib:g} GiB working set: "
              f"{read_gbs(x, n):.1f} GB/s")


if __name__ == "__main__":
    main()

"""One dense int4 matrix's decode-step product from memory (kernels.BoundMatrix on the panel order
the loader gives --dense-quant int4): the lm_head and the layers' dense matrices, a third to a half
of a host decode token. Not a test.

    .venv/bin/python bench/matrix.py [--rows 151936] [--cols 2048] [--threads 1 2] [--gib 1.2] [--quant int4]

Random codes and scales (int4: fp16, a group of 32 inputs; int8: fp32, a row), as many distinct matrices as make --gib, so that
each call reads its matrix from memory, not the last-level cache; one token; best of 5 passes. The
read bandwidth (bench/bandwidth.py's sum) is printed beside it, with the same threads.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bandwidth import read_gbs  # noqa: E402
from moefit import kernels  # noqa: E402


def matrix(rows: int, cols: int, quant: str) -> kernels.BoundMatrix:
    """Random codes in the layout the loader gives --dense-quant `quant`: int4 in panels (a group of 32,
    fp16 scales), int8 in rows (an fp32 scale a row)."""
    if quant == "int8":
        codes, scale = torch.randint(-127, 128, (rows, cols), dtype=torch.int8), torch.rand(rows) * 0.01
        return kernels.BoundMatrix({"w": codes, "w.scale": scale}, "w", "int8")
    codes = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8)
    codes, scale = kernels.rows_to_panels(codes, (torch.rand(rows, cols // 32) * 0.01).half())
    return kernels.BoundMatrix({"w": codes, "w.scale": scale}, "w", "int4p")


def seconds_a_call(mats: list, x: torch.Tensor) -> float:
    for m in mats:
        m(x)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for m in mats:
            m(x)
        best = min(best, (time.perf_counter() - t0) / len(mats))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=151936)
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--gib", type=float, default=1.2, help="distinct matrices' bytes in all")
    ap.add_argument("--quant", default="int4", choices=["int4", "int8"])
    args = ap.parse_args()
    r, c = args.rows, args.cols
    nbytes = r * c + 4 * r if args.quant == "int8" else r * c // 2 + r * c // 32 * 2
    mats = [matrix(r, c, args.quant) for _ in range(max(1, int(args.gib * 2**30 // nbytes)))]
    x, sink = torch.randn(1, args.cols), torch.ones(2**30 // 4)
    print(f"isa {kernels.isa()}; {args.quant} {r} x {c}, fp32 activations, 1 token, "
          f"{len(mats)} distinct matrices ({nbytes * len(mats) / 2**30:.2f} GiB)")
    for threads in args.threads:
        torch.set_num_threads(threads)
        kernels.set_threads(threads)
        s = seconds_a_call(mats, x)
        print(f"{threads} thread(s): {s * 1e3:.3f} ms a call, {nbytes / s / 1e9:.1f} GB/s; "
              f"the read bandwidth {read_gbs(sink, threads):.1f} GB/s")


if __name__ == "__main__":
    main()

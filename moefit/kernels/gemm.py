"""A prompt's product with a quantised matrix, by whichever way runs its shape class fastest on
this machine: timed the first time the class (rows to the next power of two, the matrix's shape
and quant) is met, every way on that very product, interleaved, best of REPEATS; then kept.

The ways (pack/quant.py prompt_linear builds them): the integer dots (moe.c, the decode path's),
or the matrix dequantised natively and torch's fp32 GEMM through MKL (F.linear) or oneDNN
(mkldnn_linear), the dequantisation in its time. Machines differ by more than 2x each way:
on a Xeon (AVX512, 2 cores) the fp32 GEMM ran a 128 x 2048 x 12352 int4 product in 49 ms, the
dots in 87; on an AMD EPYC (Zen 5, 2 cores) the dots in 21 ms, the GEMM in 50 (MKL's slow path
there; oneDNN ran an expert's 64 x 2048 x 1024 2.3x faster than MKL, yet 128 x 2048 x 8192 0.8x).
So no fixed choice would do. The results agree to fp32 rounding (tests/test_quant.py); with the
dots a token's result does not depend on the chunk it was in, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
import time

import torch
import torch.nn.functional as F

REPEATS = 2
FORCED: str | None = None                       # a way taken wherever it is offered (tests, benchmarks)
MARGIN = 0.9                                    # the first way's time, as the others see it
_way_for: dict[tuple, str] = {}                 # shape class -> the fastest way's name
Ways = dict[str, Callable[[], "torch.Tensor | None"]]


def shape_class(rows: int, *matrix) -> tuple:
    """The key a choice is kept under: rows to the next power of two, then what identifies the matrix."""
    return (1 << max(0, rows - 1).bit_length(), *matrix)


def fastest(key: tuple, ways: Ways, clock: Callable[[], float] = time.perf_counter) -> torch.Tensor | None:
    """The product by the way chosen for key (measured now when key is new: each timed run's
    result is dropped at once, then the chosen way runs again, so a prompt's product is held once).
    The first way is kept unless another is at least MARGIN faster (the noise of two runs). A way
    that returns None or raises RuntimeError (a backend refusing the operands) is out; None when
    all are."""
    if FORCED in ways:
        return ways[FORCED]()
    if key not in _way_for or _way_for[key] not in ways:
        name = _measure(ways, clock)
        if name is None:
            return None
        _way_for[key] = name
    return ways[_way_for[key]]()


def _measure(ways: Ways, clock: Callable[[], float]) -> str | None:
    best = {name: float("inf") for name in ways}
    out = set()
    for _ in range(REPEATS):
        for name, way in ways.items():
            if name in out:
                continue
            t0 = clock()
            try:
                ran = way() is not None
            except RuntimeError:
                ran = False
            if not ran:
                out.add(name)
                continue
            best[name] = min(best[name], clock() - t0)
    first = next(iter(ways))
    name = min(best, key=lambda n: best[n] * (MARGIN if n == first else 1.0))
    return None if best[name] == float("inf") else name


def chosen() -> dict[str, int]:
    """How many shape classes each way won so far (/v1/status, generate --json)."""
    counts: dict[str, int] = {}
    for way in _way_for.values():
        counts[way] = counts.get(way, 0) + 1
    return counts


def fp32_ways(x: Callable[[], torch.Tensor], w: Callable[[], torch.Tensor | None]) -> Ways:
    """torch's two fp32 GEMMs of x() [T, C] and w() [R, C] (w() None: the way is out)."""
    def mkl():
        weights = w()
        return None if weights is None else F.linear(x(), weights)

    def onednn():
        weights = w()
        if weights is None or not torch.backends.mkldnn.is_available():
            return None
        return torch._C._nn.mkldnn_linear(x().to_mkldnn(), weights.to_mkldnn()).to_dense()
    return {"mkl": mkl, "onednn": onednn}


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, C] @ w [R, C]^T in fp32 by the faster of MKL and oneDNN for this shape class (a busy
    expert's GEMM, experts/groups.py)."""
    return fastest(shape_class(x.shape[0], "fp32", w.shape[1], w.shape[0]), fp32_ways(lambda: x, lambda: w))

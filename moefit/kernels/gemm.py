"""torch's fp32 GEMM for a prompt's products (pack/quant.py gemm_linear), through MKL (F.linear)
or oneDNN (mkldnn_linear), whichever runs the shape faster on this machine: timed the first time
a shape class (rows to the next power of two, the matrix's shape) is met, then kept.

MKL takes a slow path on some CPUs: on an AMD EPYC (Zen 5, 2 cores) oneDNN ran an expert's gate_up
at 64 x 2048 x 1024 2.3x faster, reorders of both operands included, yet 128 x 2048 x 8192 0.8x;
in place of every prompt GEMM a 512-token Q4_K_M prompt went from 126 to 145 tok/s and a 128-token
one from 120 to 113, so one choice for all shapes would not do. Both are fp32 GEMMs: the results
agree to fp32 rounding.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

_onednn_for: dict[tuple[int, int, int], bool] = {}     # shape class -> oneDNN is the faster


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, C] @ w [R, C]^T in fp32, by the backend this shape class runs faster with."""
    key = (1 << max(0, x.shape[0] - 1).bit_length(), w.shape[1], w.shape[0])
    if key not in _onednn_for:
        _onednn_for[key] = _onednn_is_faster(x, w)
    return _onednn(x, w) if _onednn_for[key] else F.linear(x, w)


def _onednn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch._C._nn.mkldnn_linear(x.to_mkldnn(), w.to_mkldnn()).to_dense()


def _onednn_is_faster(x: torch.Tensor, w: torch.Tensor, repeats: int = 2) -> bool:
    """Both backends timed on this very product, interleaved, best of `repeats`; MKL on a tie
    within 10 % (it is torch's own path), and where oneDNN is missing or refuses the operands."""
    if not torch.backends.mkldnn.is_available():
        return False
    best = {False: float("inf"), True: float("inf")}
    try:
        for _ in range(repeats):
            for onednn in (False, True):
                t0 = time.perf_counter()
                _onednn(x, w) if onednn else F.linear(x, w)
                best[onednn] = min(best[onednn], time.perf_counter() - t0)
    except RuntimeError:
        return False
    return best[True] < 0.9 * best[False]

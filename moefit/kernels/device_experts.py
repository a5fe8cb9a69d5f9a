"""The device's resident-expert multiply for a few rows, fused (Triton): the packed codes are
read as they are in the slots, each group's scale applied in fp32, nothing dequantised.

    y = matvec(x, parts, "gate_up", "int4")     # x [T, C] or [m, T, C], parts [m, ...] -> [m, T, R] fp32

This is CUDA's room in `kernels/` (moe.c is the host's; the Triton kernel itself is in
triton_matvec.py, imported on first use). experts/grouped.py calls it for steps
of at most 16 rows when `usable` says so: on CUDA with Triton installed (PyTorch's CUDA wheels
bring it), or anywhere under TRITON_INTERPRET=1, which is how the tests run it on a CPU.
Elsewhere the torch path in experts/grouped.py multiplies the same numbers.

Per weight it reads the stored byte (int4: half a byte) once; the torch path writes and reads
the codes again in the compute dtype. One program computes BLOCK_R output rows of one expert
for up to 4 token rows, looping over the columns one quantisation group at a time; the sums
are fp32 throughout (the host kernel's accuracy or better).

Legend: m experts, T token rows, R / C a matrix's rows / columns, g the group size.
"""

from __future__ import annotations

import os
import warnings
from functools import lru_cache

import torch

KINDS = {"int4": 0, "q8_0": 1, "int8": 2}
INT8_STEP = 32                                # int8 has one scale a row: columns are walked 32 at a time
BLOCK_R = 32
ROWS = 4                                      # token rows a program holds (more would spill registers)


@lru_cache(maxsize=1)
def _kernel():
    """The Triton kernel's module, imported on first use (None without Triton): a CPU start
    does not pay for importing Triton."""
    try:
        from moefit.kernels import triton_matvec
    except ImportError:
        return None
    return triton_matvec


broken: str | None = None                    # why the kernel would not compile here, once it did not


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def usable(x: torch.Tensor, quant: str, parts: dict[str, torch.Tensor], name: str) -> bool:
    """Triton is here, the tensors are where it runs (CUDA, or the CPU under its interpreter),
    and the matrix's columns split into whole groups of a power of two (16 or more)."""
    if broken is not None or quant not in KINDS or not (x.is_cuda or interpreted()) or _kernel() is None:
        return False
    group = _group(quant, parts, name, x.shape[-1])
    return group >= 16 and group & (group - 1) == 0 and x.shape[-1] % group == 0


def matvec(x: torch.Tensor, parts: dict[str, torch.Tensor], name: str, quant: str) -> torch.Tensor | None:
    """x [T, C] (every expert's input) or [m, T, C] times each expert's matrix `name`
    [m, R, C] transposed, in fp32: [m, T, R]; None, and never again in this process, where the
    kernel does not compile (a Triton too old or too new): the caller's torch path runs."""
    try:
        return _matvec(x, parts, name, quant)
    except Exception as e:  # noqa: BLE001 - compilation errors come in many types; the torch path is exact
        global broken
        broken = f"{type(e).__name__}: {e}"[:300]
        warnings.warn(f"moefit: the fused expert kernel is off, the torch path runs ({broken})", stacklevel=2)
        return None


def _matvec(x: torch.Tensor, parts: dict[str, torch.Tensor], name: str, quant: str) -> torch.Tensor:
    w, scale = parts[name], parts[name + ".scale"]
    m, rows, cols = w.shape[0], w.shape[1], x.shape[-1]
    xs = x if x.dim() == 3 else x[None]
    xs = xs.contiguous()
    tokens = xs.shape[1]
    out = torch.empty(m, tokens, rows, dtype=torch.float32, device=x.device)
    group = _group(quant, parts, name, cols)
    x_stride_m = xs.stride(0) if x.dim() == 3 else 0
    launch = _kernel().launch
    for t0 in range(0, tokens, ROWS):
        n = min(ROWS, tokens - t0)
        launch(xs[:, t0:], w, scale, out[:, t0:], n, rows, cols, x_stride_m,
               xs.stride(1), w.stride(0), w.stride(1), scale.stride(0), scale.stride(1), out.stride(0), out.stride(1),
               group, KINDS[quant], BLOCK_R)
    return out


def _group(quant: str, parts: dict[str, torch.Tensor], name: str, cols: int) -> int:
    """Columns a scale covers (int8: the walk's step)."""
    if quant == "int8":
        return INT8_STEP
    return cols // parts[name + ".scale"].shape[-1]

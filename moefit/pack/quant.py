"""Quantize expert matrices into blob parts, view a blob as its parts, and multiply
by quantized weights (dequantised in the matmul path).

Legend: R rows (output features), C columns (input features), G groups per row.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import torch
import torch.nn.functional as F

from moefit import kernels
from moefit.kernels import gemm
from moefit.pack.kblocks import dequantize_blocks
from moefit.pack.layout import FLOAT_QUANTS, GGUF_BLOCKS, Q8_0_GROUP, Part, matrix_quant

TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
                "int8": torch.int8, "uint8": torch.uint8}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}
# MXFP4's e2m1 codes (gpt-oss checkpoints, GGUF MXFP4 blocks): the value of each 4-bit code
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def quantize(w: torch.Tensor, quant: str, group: int) -> list[torch.Tensor]:
    """Part tensors of matrix w [R, C], in the order layout.matrix_parts lists them: natively
    where the kernel is built (kernels.quantize, the same bits), else in torch as below."""
    if quant in FLOAT_QUANTS:
        return [w.to(TORCH_DTYPES[quant]).contiguous()]
    if (native := kernels.quantize(w, quant, group)) is not None:
        return native
    return quantize_in_torch(w, quant, group)


def quantize_in_torch(w: torch.Tensor, quant: str, group: int) -> list[torch.Tensor]:
    w = w.float()
    if quant == "int8":
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0                    # [R]
        codes = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)  # [R, C]
        return [codes, scale]
    if quant == "q8_0":                        # llama.cpp's Q8_0: d = absmax / 127 in fp16 per 32
        rows, cols = w.shape
        wg = w.view(rows, cols // Q8_0_GROUP, Q8_0_GROUP)
        scale = (wg.abs().amax(dim=2) / 127.0).to(torch.float16)               # [R, G]
        inv = torch.where(scale.float() > 0, 1.0 / scale.float(), torch.zeros(()))
        codes = torch.round(wg * inv[:, :, None]).clamp(-127, 127).to(torch.int8).view(rows, cols)
        return [codes, scale]
    rows, cols = w.shape
    wg = w.view(rows, cols // group, group)                                       # [R, G, g]
    scale = (wg.abs().amax(dim=2).clamp(min=1e-12) / 7.0).to(torch.float16)      # [R, G]
    codes = torch.round(wg / scale.float()[:, :, None]).clamp(-7, 7).to(torch.int16) + 8
    codes = codes.view(rows, cols // 2, 2)
    packed = (codes[:, :, 0] | (codes[:, :, 1] << 4)).to(torch.uint8)           # [R, C/2]
    return [packed, scale]


def dequantize(parts: dict[str, torch.Tensor], name: str, quant: str, dtype: torch.dtype) -> torch.Tensor:
    """The weight matrix `name` as a float [R, C] in dtype. Codes times scales in fp32, then
    rounded once to dtype: the host kernel keeps fp32 scales too, so an expert gives the same
    weights on either side (a bf16 scale alone would move them by up to 0.4 %)."""
    quant = matrix_quant(quant, name)
    if quant == "int4p":                                        # stored in panels (kernels.rows_to_panels)
        return dequantize(kernels.panels_to_rows(parts, name), name, "int4", dtype)
    w = parts[name]
    if quant in FLOAT_QUANTS:
        return w.to(dtype)
    if quant in GGUF_BLOCKS:
        return dequantize_blocks(w, quant).to(dtype)
    scale = parts[name + ".scale"].float()
    if quant == "int8":
        return (w.float() * scale[:, None]).to(dtype)
    if quant == "q8_0":
        rows = w.shape[0]
        return w.float().view(rows, scale.shape[1], -1).mul_(scale[:, :, None]).view(rows, -1).to(dtype)
    rows, groups = w.shape[0], scale.shape[1]
    return int4_codes(w).view(rows, groups, -1).float().mul_(scale[:, :, None]).view(rows, -1).to(dtype)


def int4_codes(w: torch.Tensor) -> torch.Tensor:
    """int4 parts [..., C/2] uint8 (two codes a byte, low nibble first, stored + 8) -> int8 [..., C]."""
    return torch.stack(((w & 0xF).to(torch.int8) - 8, (w >> 4).to(torch.int8) - 8), dim=-1).flatten(-2)


# A host product of at least this many tokens is a prompt's: it runs by the way measured fastest
# for its shape on this machine (kernels/gemm.py): the integer dots, or the matrix dequantised to
# fp32 once (natively) and torch's fp32 GEMM. Fewer tokens (decode steps, verify windows) keep
# the integer dots, whose result for a token does not depend on the others in the batch. The fp32
# copy goes into one scratch kept for the process (a fresh 100 MB buffer a call cost ~35 ms of
# page faults), at most GEMM_MAX_BYTES of host memory: a larger matrix (an lm_head over a whole
# prompt) keeps the integer dots.
GEMM_TOKENS = 96
GEMM_MAX_BYTES = 256 << 20
_gemm_scratch = torch.empty(0)


def _fp32_weights(parts: dict[str, torch.Tensor], name: str, quant: str) -> torch.Tensor | None:
    global _gemm_scratch
    rows, cols = kernels.matrix_shape(parts[name], quant)
    if rows * cols * 4 > GEMM_MAX_BYTES:
        return None
    if _gemm_scratch.numel() < rows * cols:
        _gemm_scratch = torch.empty(rows * cols, dtype=torch.float32)
    return kernels.dequantize(parts, name, quant, _gemm_scratch[:rows * cols].view(rows, cols))


def prompt_sized(tokens: int) -> bool:
    """Whether a product of this many tokens is a prompt's, which may take a GEMM (GEMM_TOKENS, read
    at call time): the dense matrices here, busy experts (experts/groups.py), the chunk's torch
    threads (runtime/engine.py). Fewer tokens (decode steps, verify windows) keep the integer dots."""
    return tokens >= GEMM_TOKENS


def gemm_linear(x: torch.Tensor, parts: dict[str, torch.Tensor], name: str, quant: str) -> torch.Tensor | None:
    """x [T, C] fp32 @ W[R, C]^T as torch's fp32 GEMM (MKL or oneDNN, the faster here: kernels/gemm.py)
    on W dequantised natively into the scratch and x rounded as the integer dots round it
    (q8_round); the caller holds kernels.torch_threads().
    None where the kernel or the bound does not take W."""
    quant = matrix_quant(quant, name)
    if not kernels.usable(x, quant) or (w := _fp32_weights(parts, name, quant)) is None:
        return None
    return gemm.linear(q8_round(x), w)


def prompt_linear(x: torch.Tensor, parts: dict[str, torch.Tensor], name: str, quant: str) -> torch.Tensor | None:
    """A prompt's x [T, C] @ W[R, C]^T by the way measured fastest for its shape class here: the
    integer dots, or MKL's or oneDNN's fp32 GEMM on W dequantised (in each one's time) and x
    rounded as the dots round it; the caller holds kernels.torch_threads(). None where the
    kernel does not take W."""
    quant = matrix_quant(quant, name)
    if not kernels.usable(x, quant):
        return None
    rounded = functools.cache(lambda: q8_round(x))                 # once, whichever ways are timed
    ways = {"dots": lambda: kernels.qlinear(x, parts, name, quant),
            **gemm.fp32_ways(rounded, lambda: _fp32_weights(parts, name, quant))}
    rows, cols = kernels.matrix_shape(parts[name], quant)
    return gemm.fastest(gemm.shape_class(x.shape[0], quant, cols, rows), ways)


def q8_round(x: torch.Tensor) -> torch.Tensor:
    """x [T, C] as the integer dots see it: each block of 32 rounded to int8 codes times its
    amax / 127 (kernels/moe.c quantize_row, bit for bit, natively: in torch it cost a fifth of a
    busy expert's GEMM). A prompt chunk's GEMM so gives a token what the dots give it, up to fp32
    rounding, whatever the chunk it was in (with fp32 activations the two paths were ~1e-2 apart;
    tests/test_quant.py). Rows the kernel does not take (not whole blocks) are multiplied in fp32
    by the dots' fallback too: x as it is."""
    rounded = kernels.q8_round(x)
    return x if rounded is None else rounded


def qlinear(x: torch.Tensor, parts: dict[str, torch.Tensor], name: str, quant: str) -> torch.Tensor:
    """x [T, C] @ W[R, C]^T with W quantized: the host kernel for a few tokens, the fastest way
    here for a prompt's many (prompt_linear); elsewhere dequantise in torch and multiply (int8
    applies its per-row scale after the matmul)."""
    if prompt_sized(x.shape[0]):
        with kernels.torch_threads():
            if (y := prompt_linear(x, parts, name, quant)) is not None:
                return y
    quant = matrix_quant(quant, name)
    if kernels.usable(x, quant) and (y := kernels.qlinear(x, parts, name, quant)) is not None:
        return y
    if quant == "int8":                    # codes are exact in bf16/fp16; the scale applies in fp32
        return (F.linear(x, parts[name].to(x.dtype)).float() * parts[name + ".scale"].float()).to(x.dtype)
    return F.linear(x, dequantize(parts, name, quant, x.dtype))


def blob_views(blob: torch.Tensor, layout: list[Part]) -> dict[str, torch.Tensor]:
    """Typed views of the parts of one expert blob (uint8 [nbytes]); no copy."""
    views = {}
    for p in layout:
        raw = blob[p.offset:p.offset + p.nbytes]
        views[p.name] = raw.view(TORCH_DTYPES[p.dtype]).view(p.shape)
    return views


class LazyViews(Mapping):
    """blob_views made at their first read: a slot the device's slot-table kernels read
    through the table's address may never need them, and they cost ~30 us a placement."""

    def __init__(self, blob: torch.Tensor, layout: list[Part]):
        self._blob, self._layout, self._views = blob, layout, None

    def _made(self) -> dict[str, torch.Tensor]:
        if self._views is None:
            self._views = blob_views(self._blob, self._layout)
        return self._views

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._made()[name]

    def __iter__(self):
        return iter(self._made())

    def __len__(self) -> int:
        return len(self._layout)

    def __contains__(self, name) -> bool:
        return any(p.name == name for p in self._layout)

    def address(self, name: str) -> int:
        """A part's address, without making the views (the host call's pointers: kernels.addresses)."""
        return self._blob.data_ptr() + next(p.offset for p in self._layout if p.name == name)

    @property
    def device(self) -> torch.device:
        return self._blob.device

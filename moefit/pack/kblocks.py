"""llama.cpp's K-quant and IQ4_XS super-blocks (256 weights each) and MXFP4 blocks (32)
dequantised in torch, on any device: the device path and the portable fallback multiply these,
the host kernel reads the blocks directly (kernels/kquants.h has the layouts). Checked against
gguf.quants.dequantize. Codes stay one byte a weight (uint8 / int8, table indices int32 half a
row at a time) until the one fp32 copy their scales multiply in place: a device step's scratch
is at most ~7 bytes a weight of the slice (it was 20-29 with int64 codes), within the plan's
memory/footprint.expert_scratch_per_weight.

Legend: R rows, B blocks per row, 256 weights a super-block, 8 sub-blocks of 32 (Q6_K: 16 of 16).
"""

from __future__ import annotations

import functools

import torch

from moefit.pack.layout import GGUF_BLOCKS

QK_K = 256
IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
MXFP4_DOUBLED = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)       # e2m1 values x 2


def dequantize_blocks(w: torch.Tensor, quant: str) -> torch.Tensor:
    """w [R, B * bytes] uint8 -> [R, B * weights] fp32."""
    rows = w.shape[0]
    blocks = w.reshape(rows, -1, GGUF_BLOCKS[quant][1])
    out = {"q4_k": _q4_k, "q5_k": _q5_k, "q6_k": _q6_k, "iq4_xs": _iq4_xs, "mxfp4": _mxfp4}[quant](blocks)
    return out.reshape(rows, -1)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Two bytes [..., 2] (little-endian fp16) -> fp32 [...]."""
    return b.contiguous().view(torch.float16)[..., 0].float()


def _scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 packed bytes [..., 12] -> 6-bit scales and mins [..., 8]."""
    s = s.int()
    lo_sc, lo_m = s[..., 0:4] & 63, s[..., 4:8] & 63
    hi_sc = (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)
    hi_m = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return torch.cat((lo_sc, hi_sc), -1).float(), torch.cat((lo_m, hi_m), -1).float()


def _nibbles_by_pairs(qs: torch.Tensor) -> torch.Tensor:
    """128 bytes [..., 128] -> 256 codes (uint8) in element order: per 32 bytes, low nibbles then high."""
    q = qs.reshape(*qs.shape[:-1], 4, 32)
    return torch.stack((q & 15, q >> 4), dim=-2).reshape(*qs.shape[:-1], 8, 32)       # [..., 8, 32]


def _scaled(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None = None) -> torch.Tensor:
    """codes (small integers) [..., n, k] -> fp32 codes * scale [..., n] (- offset [..., n]), in
    place: the codes stay one byte a weight until this one fp32 copy."""
    w = codes.float().mul_(scale[..., None])
    return w.sub_(offset[..., None]) if offset is not None else w


def _lookup(table: tuple, nibbles: torch.Tensor) -> torch.Tensor:
    """4-bit indices [..., k] into an int8 table -> int8 [..., k] (indices as int32, not int64)."""
    return _table(table, nibbles.device)[nibbles.int()]


@functools.lru_cache(maxsize=None)
def _table(values: tuple, device: torch.device) -> torch.Tensor:
    """A lookup table on the device, made once (not a host-to-device copy every step)."""
    return torch.tensor(values, dtype=torch.int8, device=device)


def _q4_k(b: torch.Tensor, fifth: torch.Tensor | None = None) -> torch.Tensor:
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, m = _scale_min(b[..., 4:16])
    q = _nibbles_by_pairs(b[..., 16:144] if fifth is None else b[..., 48:176])
    if fifth is not None:
        q |= fifth
    return _scaled(q, d[..., None] * sc, dmin[..., None] * m).flatten(-2)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    qh = b[..., 16:48]                                                               # [..., 32]
    bits = torch.stack([(qh >> j) & 1 for j in range(8)], dim=-2) << 4                # [..., 8, 32]
    return _q4_k(b, bits)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[..., 208:210])
    sc = b[..., 192:208].contiguous().view(torch.int8).float()                        # [..., 16]
    halves = []
    for h in range(2):
        ql, qh = b[..., 64 * h:64 * h + 64], b[..., 128 + 32 * h:160 + 32 * h]
        parts = [(ql[..., 32 * (k & 1):32 * (k & 1) + 32] >> (4 * (k >> 1))) & 15 | ((qh >> (2 * k)) & 3) << 4
                 for k in range(4)]
        halves.append(torch.stack(parts, dim=-2).view(torch.int8) - 32)              # [..., 4, 32]
    q = torch.cat(halves, dim=-2).reshape(*b.shape[:-1], 16, 16)                     # 16 groups of 16
    return _scaled(q, d[..., None] * sc).flatten(-2)


def _iq4_xs(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[..., 0:2])
    high = b[..., 2].int() | (b[..., 3].int() << 8)
    low = b[..., 4:8].int()
    ib = torch.arange(8, device=b.device)
    ls = ((low[..., ib // 2] >> (4 * (ib % 2))) & 15) | (((high[..., None] >> (2 * ib)) & 3) << 4)
    qs = b[..., 8:136].reshape(*b.shape[:-1], 8, 16)
    values = torch.cat((_lookup(IQ4NL, qs & 15), _lookup(IQ4NL, qs >> 4)), dim=-1)    # [..., 8, 32]
    return _scaled(values, d[..., None] * (ls - 32).float()).flatten(-2)


def _mxfp4(b: torch.Tensor) -> torch.Tensor:
    """An e8m0 exponent e, then 16 bytes of e2m1 codes (low nibbles elements 0-15): the doubled
    value x 2^(e - 128)."""
    qs = b[..., 1:17]
    values = torch.cat((_lookup(MXFP4_DOUBLED, qs & 15), _lookup(MXFP4_DOUBLED, qs >> 4)), dim=-1)   # [..., 32]
    return values.float().mul_(torch.exp2(b[..., 0:1].float() - 128))

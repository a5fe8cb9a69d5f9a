"""The Triton kernel behind kernels/device_experts.py (imported only where Triton is installed):
a few token rows times m experts' quantised matrices, read as stored, summed in fp32."""

from __future__ import annotations

import triton
import triton.language as tl


def launch(x, w, scale, out, tokens: int, rows: int, cols: int, sxm: int, sxt: int, swm: int, swr: int,
           ssm: int, ssr: int, som: int, sot: int, group: int, kind: int, block_r: int) -> None:
    """One launch: a program for each (expert, block of rows)."""
    grid = (w.shape[0], triton.cdiv(rows, block_r))
    _grouped_matvec[grid](x, w, scale, out, tokens, rows, cols, sxm, sxt, swm, swr, ssm, ssr, som, sot,
                          GROUP=group, KIND=kind, TP=max(2, triton.next_power_of_2(tokens)), BLOCK_R=block_r)


@triton.jit
def _grouped_matvec(x_ptr, w_ptr, s_ptr, out_ptr, T, R, C,
                    sxm, sxt, swm, swr, ssm, ssr, som, sot,
                    GROUP: tl.constexpr, KIND: tl.constexpr, TP: tl.constexpr, BLOCK_R: tl.constexpr):
    """KIND 0: int4 (two codes a byte, low nibble first, stored + 8), fp16 scale a group;
    1: Q8_0 (int8 codes, fp16 scale a group); 2: int8 (fp32 scale a row, applied at the end)."""
    e = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    ts = tl.arange(0, TP)
    tmask = ts < T
    x_rows = x_ptr + e * sxm + ts[:, None] * sxt
    w_rows = w_ptr + e * swm + rows[:, None] * swr
    acc = rows_dot(x_rows, tmask, w_rows, rmask, s_ptr + e * ssm + rows * ssr, C, GROUP, KIND, TP, BLOCK_R)
    tl.store(out_ptr + e * som + ts[:, None] * sot + rows[None, :], acc, mask=tmask[:, None] & rmask[None, :])


@triton.jit
def rows_dot(x_rows, tmask, w_rows, rmask, s_rows, C, GROUP: tl.constexpr, KIND: tl.constexpr, TP: tl.constexpr,
             BLOCK: tl.constexpr):
    """[TP, BLOCK] fp32: x rows (pointers [TP, 1]) times matrix rows (pointers to their codes
    [BLOCK, 1], to their first scale [BLOCK]), the codes read as stored, each group's scale
    applied to its fp32 partial sum (int8: the row's scale at the end). Also triton_moe's."""
    acc = tl.zeros((TP, BLOCK), dtype=tl.float32)
    for g0 in range(0, C, GROUP):
        if KIND == 0:
            b = tl.arange(0, GROUP // 2)
            byte = tl.load(w_rows + (g0 // 2 + b)[None, :], mask=rmask[:, None], other=0x88).to(tl.int32)
            lo = ((byte & 0xF) - 8).to(tl.float32)
            hi = ((byte >> 4) - 8).to(tl.float32)
            xe = tl.load(x_rows + (g0 + 2 * b)[None, :], mask=tmask[:, None], other=0.0).to(tl.float32)
            xo = tl.load(x_rows + (g0 + 2 * b + 1)[None, :], mask=tmask[:, None], other=0.0).to(tl.float32)
            part = tl.sum(xe[:, None, :] * lo[None, :, :] + xo[:, None, :] * hi[None, :, :], axis=2)
        else:
            c = tl.arange(0, GROUP)
            code = tl.load(w_rows + (g0 + c)[None, :], mask=rmask[:, None], other=0).to(tl.float32)
            xv = tl.load(x_rows + (g0 + c)[None, :], mask=tmask[:, None], other=0.0).to(tl.float32)
            part = tl.sum(xv[:, None, :] * code[None, :, :], axis=2)
        if KIND == 2:
            acc += part
        else:
            acc += part * tl.load(s_rows + g0 // GROUP, mask=rmask, other=0.0).to(tl.float32)[None, :]
    if KIND == 2:
        acc = acc * tl.load(s_rows, mask=rmask, other=0.0).to(tl.float32)[None, :]
    return acc

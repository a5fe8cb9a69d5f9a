"""The Triton kernels behind kernels/device_moe.py (imported only where Triton is installed): a
MoE layer's resident experts for a few token rows, read from their cache slots through the
device's slot table, so that the host need not know yet which experts the router chose.

Two launches a layer (per 4 token rows for the first):

    _gate_up_act   a program per (expert of the layer, block of intermediate rows): nothing to do
                   unless the table has a slot for the expert and some token routed to it; else
                   SiLU(gate) * up of those tokens, fp32, into h[token, rank]
    _down_sum      a program per (token, block of hidden rows): over the token's top-k ranks in
                   order, the router weight times down(h) of each resident expert, fp32

A slot's address is a byte offset from `base` (any device tensor: the table itself), so one
pointer reaches every chunk of the pool; 0 in the table means "not on the card" (the host
computes that expert). Matrix kinds as kernels/triton_matvec.py: 0 int4 (two codes a byte, low
nibble first, stored + 8; fp16 scale a group), 1 Q8_0 (int8 codes, fp16 scale a group), 2 int8
(fp32 scale a row, applied at the end; columns walked GROUP at a time); and a GGUF file's blocks as
it stores them (kquants.h's layouts), 32 weights at a time: 3 Q4_K, 4 Q6_K, 5 Q5_K, 6 IQ4_XS
(super-blocks of 256), 7 MXFP4 (blocks of 32). gate_up and down may be of different kinds (a
Q4_K_M file's Q4_K gate and up, Q6_K down).

ACT picks the expert function: 0 SwiGLU, 1 gpt-oss's (biases, a clamped gate: models/gpt_oss.py)
with the biases read from the layer's [N, 2I] and [N, E] rows and alpha / limit as arguments.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moefit.kernels.triton_matvec import rows_dot


def launch_gate_up(x, ids, table, base, h, tokens: int, k: int, inter: int, cols: int, offsets: tuple,
                   group: int, kind: int, block: int, act=None) -> None:
    grid = (table.shape[0], triton.cdiv(inter, block))
    bias, alpha, limit = (base, 0.0, 0.0) if act is None else (act.gate_up_bias, act.alpha, act.limit)
    _gate_up_act[grid](x, ids, table, base, base.data_ptr(), h, bias, alpha, limit, tokens, k, inter, cols, x.stride(0),
                       *offsets, GROUP=group, KIND=kind, ACT=int(act is not None),
                       TP=max(2, triton.next_power_of_2(tokens)), KP=max(2, triton.next_power_of_2(k)), BLOCK=block)


def launch_down(h, ids, weights, table, base, out, tokens: int, k: int, inter: int, hidden: int, offsets: tuple,
                group: int, kind: int, block: int, act=None) -> None:
    grid = (tokens, triton.cdiv(hidden, block))
    _down_sum[grid](h, ids, weights, table, base, base.data_ptr(), out, base if act is None else act.down_bias,
                    k, inter, hidden, *offsets, GROUP=group, KIND=kind, ACT=int(act is not None), BLOCK=block)


@triton.jit
def _codes_and_scales(blob, codes_at, scales_at, KIND: tl.constexpr):
    """Typed pointers to a matrix's codes and scales inside a slot (a super-block kind's scales are
    in its blocks)."""
    if KIND == 0 or KIND >= 3:
        codes = blob + codes_at
    else:
        codes = (blob + codes_at).to(tl.pointer_type(tl.int8))
    if KIND == 2:
        scales = (blob + scales_at).to(tl.pointer_type(tl.float32))
    else:
        scales = (blob + scales_at).to(tl.pointer_type(tl.float16))
    return codes, scales


@triton.jit
def _rows_dot(x_rows, tmask, codes, scales, rows, rmask, C, GROUP: tl.constexpr, KIND: tl.constexpr,
              TP: tl.constexpr, BLOCK: tl.constexpr):
    """triton_matvec.rows_dot over matrix rows `rows` of a slot's contiguous codes and scales."""
    if KIND == 7:
        return _k_rows_dot(x_rows, tmask, codes + rows[:, None] * (C // 32 * 17), rmask, C, KIND, TP, BLOCK)
    if KIND >= 3:
        row_bytes = C // 256 * (144 if KIND == 3 else 210 if KIND == 4 else 176 if KIND == 5 else 136)
        return _k_rows_dot(x_rows, tmask, codes + rows[:, None] * row_bytes, rmask, C, KIND, TP, BLOCK)
    if KIND == 0:
        w_rows = codes + rows[:, None] * (C // 2)
    else:
        w_rows = codes + rows[:, None] * C
    if KIND == 2:
        s_rows = scales + rows
    else:
        s_rows = scales + rows * (C // GROUP)
    return rows_dot(x_rows, tmask, w_rows, rmask, s_rows, C, GROUP, KIND, TP, BLOCK)


@triton.jit
def _half(lo, hi):
    """Two bytes (little-endian) as the fp16 they hold, in fp32."""
    return (lo.to(tl.int32) | (hi.to(tl.int32) << 8)).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


IQ4NL_LOW = tl.constexpr(0xF6EADDCFBFAD9881 - (1 << 64))     # IQ4_XS's table (kvalues_iq4nl) as bytes: 0-7 ...
IQ4NL_HIGH = tl.constexpr(0x7159453526190D01)                 # ... and 8-15


@triton.jit
def _iq4nl(index):
    """kvalues_iq4nl[index] (index 0..15, int32) without a table in memory."""
    packed = tl.where(index < 8, tl.full(index.shape, IQ4NL_LOW, tl.int64), tl.full(index.shape, IQ4NL_HIGH, tl.int64))
    byte = ((packed >> (8 * (index % 8)).to(tl.int64)) & 0xFF).to(tl.int32)
    return tl.where(byte >= 128, byte - 256, byte)


MXFP4_DOUBLED = tl.constexpr(0x0C08060403020100)                # |2 e2m1| for the codes 0-7 as bytes


@triton.jit
def _mxfp4(code):
    """kvalues_mxfp4[code] (code 0..15, int32: the doubled e2m1 value, bit 3 its sign)."""
    byte = ((tl.full(code.shape, MXFP4_DOUBLED, tl.int64) >> (8 * (code % 8)).to(tl.int64)) & 0xFF).to(tl.int32)
    return tl.where(code >= 8, -byte, byte)


@triton.jit
def _e8m0_half(e):
    """2^(e - 128) in fp32 for an e8m0 byte e (int32), as GGML_E8M0_TO_FP32_HALF makes it."""
    bits = tl.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _k_scale_min(blk, j, rm):
    """Q4_K / Q5_K's sub-block j scale and min (get_scale_min_k4), [BLOCK, 1] int32."""
    near = tl.load(blk + 4 + j, mask=rm, other=0).to(tl.int32)               # scales[j]
    far = tl.load(blk + 4 + (j + 4) % 8, mask=rm, other=0).to(tl.int32)      # scales[j + 4], or [j - 4]
    top = tl.load(blk + 12 + j % 4, mask=rm, other=0).to(tl.int32)           # scales[8 + j % 4]
    sc = tl.where(j < 4, near & 63, (top & 0xF) | ((far >> 6) << 4))
    m = tl.where(j < 4, far & 63, (top >> 4) | ((near >> 6) << 4))
    return sc, m


@triton.jit
def _k_rows_dot(x_rows, tmask, w_rows, rmask, C, KIND: tl.constexpr, TP: tl.constexpr, BLOCK: tl.constexpr):
    """[TP, BLOCK] fp32: x rows times matrix rows stored as GGUF super-blocks of 256 (w_rows: each
    row's first byte, [BLOCK, 1]), 32 weights at a time dequantised as kquants.h's portable bodies
    read them: Q4_K d sc q - dmin m (its 6-bit scales and mins unpacked), Q5_K the same with a fifth
    bit, Q6_K d sc (q - 32) (a scale each 16), IQ4_XS d (ls - 32) times the table's value, MXFP4
    the doubled e2m1 value times 2^(e - 128)."""
    c = tl.arange(0, 32)
    rm = rmask[:, None]
    acc = tl.zeros((TP, BLOCK), dtype=tl.float32)
    for g0 in range(0, C, 32):
        j = (g0 % 256) // 32                                        # the block of 32 in its super-block
        if KIND == 7:
            blk = w_rows + (g0 // 32) * 17
            scale = _e8m0_half(tl.load(blk, mask=rm, other=0).to(tl.int32))
            byte = tl.load(blk + 1 + c[None, :] % 16, mask=rm, other=0).to(tl.int32)
            w = scale * _mxfp4((byte >> (4 * (c[None, :] // 16))) & 0xF).to(tl.float32)
        elif KIND == 3 or KIND == 5:
            blk = w_rows + (g0 // 256) * (144 if KIND == 3 else 176)
            d = _half(tl.load(blk, mask=rm, other=0), tl.load(blk + 1, mask=rm, other=0))
            dmin = _half(tl.load(blk + 2, mask=rm, other=0), tl.load(blk + 3, mask=rm, other=0))
            sc, m = _k_scale_min(blk, j, rm)
            codes = blk + (16 if KIND == 3 else 48)
            byte = tl.load(codes + (j // 2) * 32 + c[None, :], mask=rm, other=0).to(tl.int32)
            q = (byte >> (4 * (j % 2))) & 0xF
            if KIND == 5:                                           # the fifth bit: bit j of qh[l]
                q = q | (((tl.load(blk + 16 + c[None, :], mask=rm, other=0).to(tl.int32) >> j) & 1) << 4)
            w = d * sc.to(tl.float32) * q.to(tl.float32) - dmin * m.to(tl.float32)
        elif KIND == 6:
            blk = w_rows + (g0 // 256) * 136
            d = _half(tl.load(blk, mask=rm, other=0), tl.load(blk + 1, mask=rm, other=0))
            high = tl.load(blk + 2 + j // 4, mask=rm, other=0).to(tl.int32)              # scales_h, its byte
            low = tl.load(blk + 4 + j // 2, mask=rm, other=0).to(tl.int32)               # scales_l[j / 2]
            ls = ((low >> (4 * (j % 2))) & 0xF) | (((high >> (2 * (j % 4))) & 3) << 4)
            byte = tl.load(blk + 8 + 16 * j + c[None, :] % 16, mask=rm, other=0).to(tl.int32)
            w = (d * (ls - 32).to(tl.float32)) * _iq4nl((byte >> (4 * (c[None, :] // 16))) & 0xF).to(tl.float32)
        else:
            blk = w_rows + (g0 // 256) * 210
            half = j // 4
            g = j % 4
            low = tl.load(blk + 64 * half + (g % 2) * 32 + c[None, :], mask=rm, other=0).to(tl.int32)
            high = tl.load(blk + 128 + 32 * half + c[None, :], mask=rm, other=0).to(tl.int32)
            q = ((low >> (4 * (g // 2))) & 0xF) | (((high >> (2 * g)) & 3) << 4)
            sc = tl.load(blk + 192 + (g0 % 256) // 16 + c[None, :] // 16, mask=rm, other=0)
            d = _half(tl.load(blk + 208, mask=rm, other=0), tl.load(blk + 209, mask=rm, other=0))
            w = d * sc.to(tl.int8, bitcast=True).to(tl.float32) * (q - 32).to(tl.float32)
        xv = tl.load(x_rows + (g0 + c)[None, :], mask=tmask[:, None], other=0.0).to(tl.float32)
        acc += tl.sum(xv[:, None, :] * w[None, :, :], axis=2)
    return acc


@triton.jit
def _gate_up_act(x_ptr, ids_ptr, table_ptr, base_ptr, base_addr, h_ptr, bias_ptr, alpha, limit, T, K, I, C, sxt,
                 gu_at, gu_scale_at, down_at, down_scale_at,
                 GROUP: tl.constexpr, KIND: tl.constexpr, ACT: tl.constexpr, TP: tl.constexpr, KP: tl.constexpr,
                 BLOCK: tl.constexpr):
    e = tl.program_id(0)
    addr = tl.load(table_ptr + e)
    if addr != 0:
        ts = tl.arange(0, TP)
        js = tl.arange(0, KP)
        tmask = ts < T
        chosen = tl.load(ids_ptr + ts[:, None] * K + js[None, :], mask=tmask[:, None] & (js < K)[None, :], other=-1)
        hit = chosen == e
        routed = tl.sum(hit.to(tl.int32), axis=1) > 0                          # [TP]
        if tl.sum(routed.to(tl.int32), axis=0) > 0:
            rank = tl.sum(tl.where(hit, js[None, :], 0), axis=1)                # [TP]: where the token chose e
            codes, scales = _codes_and_scales(base_ptr + (addr - base_addr), gu_at, gu_scale_at, KIND)
            rows = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
            rmask = rows < I
            x_rows = x_ptr + ts[:, None] * sxt
            gate = _rows_dot(x_rows, routed, codes, scales, rows, rmask, C, GROUP, KIND, TP, BLOCK)
            up = _rows_dot(x_rows, routed, codes, scales, rows + I, rmask, C, GROUP, KIND, TP, BLOCK)
            if ACT == 1:                                                        # gpt-oss: biased, clamped
                gate += tl.load(bias_ptr + e * 2 * I + rows, mask=rmask, other=0.0).to(tl.float32)[None, :]
                up += tl.load(bias_ptr + e * 2 * I + I + rows, mask=rmask, other=0.0).to(tl.float32)[None, :]
                gate = tl.minimum(gate, limit)
                up = tl.minimum(tl.maximum(up, -limit), limit)
                h = gate / (1.0 + tl.exp(-alpha * gate)) * (up + 1.0)
            else:
                h = gate / (1.0 + tl.exp(-gate)) * up
            tl.store(h_ptr + (ts * K + rank)[:, None] * I + rows[None, :], h, mask=routed[:, None] & rmask[None, :])


@triton.jit
def _down_sum(h_ptr, ids_ptr, w_ptr, table_ptr, base_ptr, base_addr, out_ptr, bias_ptr, K, I, E,
              gu_at, gu_scale_at, down_at, down_scale_at,
              GROUP: tl.constexpr, KIND: tl.constexpr, ACT: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    rmask = rows < E
    one = tl.arange(0, 2) < 1                                                  # a single input row
    acc = tl.zeros((2, BLOCK), dtype=tl.float32)
    for j in range(0, K):
        e = tl.load(ids_ptr + t * K + j)
        addr = tl.load(table_ptr + e)
        if addr != 0:
            weight = tl.load(w_ptr + t * K + j).to(tl.float32)
            codes, scales = _codes_and_scales(base_ptr + (addr - base_addr), down_at, down_scale_at, KIND)
            h_row = h_ptr + (t * K + j) * I + tl.zeros((2, 1), dtype=tl.int32)
            y = _rows_dot(h_row, one, codes, scales, rows, rmask, I, GROUP, KIND, 2, BLOCK)
            if ACT == 1:                                                        # gpt-oss: down's bias
                y += tl.load(bias_ptr + e * E + rows, mask=rmask, other=0.0).to(tl.float32)[None, :]
            acc += weight * y
    tl.store(out_ptr + t * E + rows[None, :] + tl.zeros((2, 1), dtype=tl.int32), acc,
             mask=one[:, None] & rmask[None, :])

"""MLA's decode step in one native call (kernels/mla.h), for models/deepseek_v3.py with its
matrices quantised: from the layer's normed input to the output projection's input, the token's
rope key and latent written to the state's rows."""

from __future__ import annotations

import ctypes

import torch

from moefit.kernels import Q, group_of, matrix_shape
from moefit.kernels.rows import F32, KvPair, _block_norms, _fn, _host_fp32, _p, _ptr

c_i64, c_ptr, c_f, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int


class _Matrix(ctypes.Structure):
    _fields_ = [("quant", c_int), ("group", c_i64), ("w", c_ptr), ("scales", c_ptr)]


class _LatentWeights(ctypes.Structure):
    _fields_ = [("E", c_i64), ("H", c_i64), ("r", c_i64), ("dr", c_i64), ("dn", c_i64), ("dv", c_i64),
                ("q_rank", c_i64), ("q_a", _Matrix), ("q", _Matrix), ("kv_a", _Matrix), ("uk", _Matrix),
                ("uv", _Matrix), ("q_norm", c_ptr), ("kv_norm", c_ptr), ("eps", c_f), ("scale", c_f),
                ("interleaved", c_int), ("o", _Matrix), ("in_norm", c_ptr), ("post_norm", c_ptr)]


def _matrix(w) -> tuple[_Matrix, int] | None:
    """A QWeight (models/layers.py) as mla.h takes it, and its column count; None for a plain tensor."""
    if w is None:
        return _Matrix(0, 0, None, None), 0
    parts = getattr(w, "parts", None)
    if parts is None or not parts["w"].is_cpu or w.quant not in Q:
        return None
    cols = matrix_shape(parts["w"], w.quant)[1]
    return _Matrix(Q[w.quant], group_of(w.quant, cols, parts["w.scale"]), _p(parts["w"]), _p(parts["w.scale"])), cols


class LatentStep:
    """One MLA layer's decode-step attention (mla.h), its weights bound once: q_a (None without a
    query rank), q, kv_a and the heads' stacked W_uk^T and W_uv, all quantised (QWeight); the two
    norms; heads; dims (r, dr, dn, dv); the softmax scale; interleaved: DeepSeek's rope_interleave.
    `block`: o_proj (a QWeight) and the layer's input and post-attention norms [E], with which the
    step is also a block (`blocks`: the residual stream in, its sum with the sublayer's output and
    that sum's norm out, as kernels/step.h's)."""

    def __init__(self, q_a, q, kv_a, uk, uv, q_norm: torch.Tensor | None, kv_norm: torch.Tensor, heads: int,
                 dims: tuple[int, int, int, int], eps: float, scale: float, interleaved: bool,
                 block: tuple | None = None):
        mats = [_matrix(m) for m in (q_a, q, kv_a, uk, uv)]
        self.fn = _fn("moe_mla_step")
        self.usable = self.fn is not None and None not in mats and _host_fp32(kv_norm) and _host_fp32(q_norm)
        self.kv_pair, self.blocks = KvPair(), False
        if not self.usable:
            return
        (qa, _), (qm, _), (kva, e), (ukm, _), (uvm, _) = mats
        self.keep = (q_a, q, kv_a, uk, uv, q_norm, kv_norm)      # the addresses bound stay theirs
        self.heads, self.dv = heads, dims[3]
        q_rank = 0 if q_a is None else matrix_shape(q_a.parts["w"], q_a.quant)[0]
        o, norms = self._block_parts(block, e, heads * dims[3])
        self.blocks = o is not None
        self.weights = _LatentWeights(e, heads, *dims, q_rank, qa, qm, kva, ukm, uvm, _ptr(q_norm), _p(kv_norm), eps,
                                      scale, int(interleaved), o or _Matrix(0, 0, None, None), *map(_ptr, norms))

    def _block_parts(self, block: tuple | None, e: int, width: int) -> tuple[_Matrix | None, tuple]:
        """o_proj as mla.h takes it and the two norms, where the step can be a block; else (None, (None, None))."""
        matrix = _matrix(block[0]) if block is not None else None
        if matrix is None or matrix[1] != width or matrix_shape(block[0].parts["w"], block[0].quant)[0] != e or \
                not _block_norms(block[1:], e):
            return None, (None, None)
        self.keep += block
        return matrix[0], block[1:]

    def __call__(self, x: torch.Tensor, pos: int, cos: torch.Tensor, sin: torch.Tensor, k, v, block: bool = False):
        """x [1, E] at position pos, cos / sin [1, dr]; k, v the state's writable rows (rope keys,
        latents; runtime/state.writable_rows) -> [1, H*dv], the token's row written; None where
        the kernel does not take them (then nothing was written). As a `block` (where it `blocks`),
        x is the residual stream -> (x + the sublayer's output, that sum's post-attention norm)."""
        if not (self.usable and _host_fp32(x) and x.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()) \
                or block and not self.blocks:
            return None
        described = self.kv_pair(k, v)
        if described is None:
            return None
        kr, vr = described
        out = torch.empty(1, x.shape[1] if block else self.heads * self.dv, dtype=F32)
        h = torch.empty(1, x.shape[1], dtype=F32) if block else None
        ok = self.fn(ctypes.byref(self.weights), _p(x), pos, _p(cos), _p(sin), ctypes.byref(kr), ctypes.byref(vr),
                     _p(out), _ptr(h))
        if ok != 0 and block:
            self.blocks = False                  # refused before writing: o_proj's shape, perhaps
        return None if ok != 0 else (out, h) if block else out

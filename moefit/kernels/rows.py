"""The step's float operations between the quantised matrices, natively (rows.h): RMSNorm, a
projection's heads normed and rotated, one position's attention, a softmax router's top-k; and
the one-call decode steps, a GQA layer's attention (step.h) and a Gated DeltaNet layer (delta.h). Each returns None where the
kernel does not take the tensors (not fp32 host rows of the strides it reads, dims not a multiple
of 16, no library), and the caller (models/layers.py) uses torch."""

from __future__ import annotations

import ctypes

import torch

from moefit.kernels import _p, library

c_i64, c_ptr, c_f = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
SIGNATURES = {
    "moe_rms_norm": [c_ptr, c_i64, c_i64, c_i64, c_ptr, c_f, c_ptr],
    "moe_head_rows": [c_ptr, c_i64, c_i64, c_i64, c_i64, c_i64, c_ptr, c_f, c_ptr, c_ptr, c_i64, c_ptr],
    "moe_softmax_topk": [c_ptr, c_i64, c_i64, c_ptr, ctypes.c_int, c_ptr, c_i64, c_i64, ctypes.c_int, c_ptr, c_ptr],
    "moe_sigmoid_topk": [c_ptr, c_i64, c_i64, c_ptr, ctypes.c_int, c_ptr, c_i64, c_i64, c_i64, c_i64, ctypes.c_int,
                         c_f, c_ptr, c_ptr],
    "moe_attention_step": [c_ptr, c_ptr, c_ptr, c_ptr, c_i64, c_ptr, c_ptr, c_i64, c_ptr, c_i64, c_ptr, c_ptr],
    "moe_attend_one": [c_ptr, c_ptr, c_ptr, c_i64, c_i64, c_i64, c_i64, c_i64, c_i64, c_i64, c_f, c_ptr],
    "moe_delta_step": [c_ptr, c_ptr, c_ptr, c_ptr, c_ptr],
    "moe_delta_block": [c_ptr, c_ptr, c_ptr, c_ptr, c_ptr, c_ptr, c_ptr],
    "moe_attend_stored": [c_ptr, c_i64, c_i64, c_i64, c_ptr, c_ptr, c_f, c_ptr, c_ptr],
    "moe_attend_latent": [c_ptr, c_i64, c_i64, c_i64, c_ptr, c_ptr, c_f, c_ptr, c_ptr],
    "moe_mla_step": [c_ptr, c_ptr, c_i64, c_ptr, c_ptr, c_ptr, c_ptr, c_ptr, c_ptr],
    "moe_kv_put": [c_ptr, c_i64, c_i64, c_ptr, c_ptr],
    "moe_turn_rows": [c_ptr, c_i64, c_i64, c_ptr, ctypes.c_int],
}


_bound: dict = {}                        # name -> the library's function with its signature, or False


def _fn(name: str):
    """The library's function `name` with its signature, or None (no library, or one built before
    it; host calls off on this thread). Looked up once: a decode layer makes several calls."""
    lib = library()
    if lib is None:
        return None
    fn = _bound.get(name)
    if fn is None:
        fn = _bound[name] = getattr(lib, name, None) or False
        if fn and fn.argtypes is None:
            fn.argtypes, fn.restype = SIGNATURES[name], ctypes.c_int
    return fn or None


F32 = torch.float32
CONTIGUOUS = torch.contiguous_format    # empty_like(x, memory_format=CONTIGUOUS): half of torch.empty(x.shape)'s time


def _host_fp32(t: torch.Tensor | None) -> bool:
    return t is None or (t.dtype is F32 and t.is_cpu)


def _host_rows(t: torch.Tensor | None) -> bool:
    """None, or fp32 host memory in one contiguous run: what a bound native call reads."""
    return t is None or (_host_fp32(t) and t.is_contiguous())


def router_rows(w: torch.Tensor) -> bool:
    """A router's matrix as the native routers read it: fp32 or bf16 (widened as read) host rows."""
    return w.dtype in (F32, torch.bfloat16) and w.is_cpu and w.is_contiguous()


def _block_norms(norms: tuple | None, n: int) -> bool:
    """Whether a block's two norm weights (the layer's input and post-attention) are [n] rows it reads."""
    return norms is not None and all(t is not None and _host_rows(t) and t.shape == (n,) for t in norms)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else _p(t)


def rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor | None:
    """RMSNorm(x) * w over x's last dim: x [..., n] contiguous, or [T, n] with rows strided."""
    fn, n = _fn("moe_rms_norm"), x.shape[-1]
    if fn is None or not (_host_fp32(x) and _host_fp32(w)) or (w is not None and not w.is_contiguous()):
        return None
    if x.is_contiguous():
        rows, stride = x.numel() // max(n, 1), n
    elif x.dim() == 2 and x.stride(1) == 1:
        rows, stride = x.shape[0], x.stride(0)
    else:
        return None
    out = torch.empty_like(x, memory_format=CONTIGUOUS) if stride == n else torch.empty(x.shape, dtype=F32)
    return out if fn(_p(x), rows, n, stride, _ptr(w), eps, _p(out)) == 0 else None


def head_rows(x: torch.Tensor, w: torch.Tensor | None, eps: float, cos: torch.Tensor | None,
              sin: torch.Tensor | None) -> torch.Tensor | None:
    """x [T, H, D] (a view of a projection: each head's D channels contiguous) -> [H, T, D], each
    head RMS-normed by w [D] when given, its first cos.shape[-1] channels rotated (rotate-half RoPE)."""
    fn = _fn("moe_head_rows")
    t, h, d = x.shape
    if fn is None or not (_host_fp32(x) and _host_fp32(w) and _host_fp32(cos)) or x.stride(2) != 1:
        return None
    if w is not None and not w.is_contiguous() or cos is not None and not (cos.is_contiguous() and sin.is_contiguous()):
        return None
    rot = cos.shape[-1] if cos is not None else 0
    out = torch.empty(h, t, d, dtype=torch.float32)
    ok = fn(_p(x), t, h, d, x.stride(0), x.stride(1), _ptr(w), eps, _ptr(cos), _ptr(sin), rot, _p(out))
    return out if ok == 0 else None


def attend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor | None:
    """q [H, 1, D] (one position) against k [K, S, D], v [K, S, Dv] (each head's rows contiguous,
    heads strided: a view of the cache) -> [H, 1, Dv], softmax(q.k * scale) with no mask."""
    fn = _fn("moe_attend_one")
    (h, t, d), (kh, s, _), dv = q.shape, k.shape, v.shape[-1]
    if fn is None or t != 1 or not (_host_fp32(q) and _host_fp32(k) and _host_fp32(v)) or not q.is_contiguous():
        return None
    if k.stride(2) != 1 or k.stride(1) != d or v.stride(2) != 1 or v.stride(1) != dv:
        return None
    out = torch.empty(h, 1, dv, dtype=torch.float32)
    ok = fn(_p(q), _p(k), _p(v), h, kh, s, d, dv, k.stride(0), v.stride(0), d ** -0.5 if scale is None else scale,
            _p(out))
    return out if ok == 0 else None


class _KvRows(ctypes.Structure):
    _fields_ = [("codec", ctypes.c_int), ("x", c_ptr), ("s", c_ptr), ("capacity", c_i64), ("n", c_i64),
                ("rot", c_ptr)]


def _kv_rows(rows) -> _KvRows | None:
    """kv.h's description of a StoredRows (runtime/kv_codecs.py), or None where the kernel cannot read it."""
    x, s = rows.store["x"], rows.store.get("s")
    if not x.is_cpu or not x.is_contiguous() or s is not None and not s.is_contiguous() or \
            rows.offset + rows.count > x.shape[1]:
        return None
    first = (lambda t: _p(t) + rows.offset * t.stride(1) * t.element_size())      # row `offset` of each head
    return _KvRows(rows.codec.native, first(x), None if s is None else first(s), x.shape[1], rows.codec.d,
                   _rotation(rows.codec))


def _rotation(codec) -> int | None:
    """The address of a q4 codec's rotation [d, d] (fp32, host, contiguous: kv_codecs makes it so)."""
    r = codec.rotation
    return None if r is None or not (r.is_cpu and r.dtype is F32 and r.is_contiguous()) else _p(r)


def kv_put(rows, positions: torch.Tensor, x: torch.Tensor) -> bool:
    """x [K, T, d] written as rows `positions` [T] of each head of a whole host store (a StoredRows
    from row 0), as kv.h's writer codes them (kernels/kv_write.h moe_kv_put); False, having
    written nothing, where it cannot."""
    fn = _fn("moe_kv_put")
    described = _kv_rows(rows) if fn is not None else None
    if described is None or positions.numel() != x.shape[1]:
        return False
    x = x.to("cpu", F32).contiguous()
    pos = positions.to(torch.int64).contiguous()
    return fn(ctypes.byref(described), x.shape[0], x.shape[1], _p(pos), _p(x)) == 0


def turn_rows(x: torch.Tensor, rotation: torch.Tensor, back: bool = False) -> torch.Tensor | None:
    """x [..., n] @ rotation (back: @ rotation^T) as the native step turns q4's query and output
    (step.h turn_rows: the same sums in the same order); None where it does not take them."""
    fn = _fn("moe_turn_rows")
    if fn is None or not (_host_fp32(x) and _host_fp32(rotation) and rotation.is_contiguous()):
        return None
    out = x.clone(memory_format=torch.contiguous_format)       # turned in place: one copy
    fn(_p(out), out.numel() // x.shape[-1], x.shape[-1], _p(rotation), int(back))
    return out


class KvPair:
    """kv.h's descriptions of a (k, v) pair of StoredRows, made again only when a step is handed
    another pair: a state hands its decode steps the same whole-store pair every token
    (runtime/state.py AttentionState.whole), and the stores it describes live as long as it."""

    def __init__(self):
        self.k = self.v = self.described = None

    def __call__(self, k, v) -> tuple[_KvRows, _KvRows] | None:
        if k is not self.k or v is not self.v:
            kr, vr = _kv_rows(k), _kv_rows(v)
            self.k, self.v, self.described = k, v, None if kr is None or vr is None else (kr, vr)
        return self.described


def attend_stored(q: torch.Tensor, k, v, scale: float,
                  latent: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
    """q [K, R, D] (each kv head's query rows) against every stored row of k and v (StoredRows
    in host memory, any codec) -> (out [K, R, Dv] fp32, log-sum-exp [K, R, 1]). `latent`: MLA's
    attention in its latent, q [K, R, Dv + Dk] against rope keys k and latents v (kernels/kv.h)."""
    fn = _fn("moe_attend_latent" if latent else "moe_attend_stored")
    kr, vr = _kv_rows(k), _kv_rows(v)
    if fn is None or kr is None or vr is None or k.count != v.count:
        return None
    q = q.to("cpu", torch.float32).contiguous()
    kh, r, _ = q.shape
    out, lse = torch.empty(kh, r, v.codec.d, dtype=F32), torch.empty(kh, r, 1, dtype=F32)
    ok = fn(_p(q), kh, r, k.count, ctypes.byref(kr), ctypes.byref(vr), scale, _p(out), _p(lse))
    return (out, lse) if ok == 0 else None


def softmax_topk(x: torch.Tensor, w: torch.Tensor, k: int, renorm: bool,
                 bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A softmax router: (weights [T, k] fp32, ids [T, k] int64), the k most probable experts of
    softmax(x [T, E] . w [N, E] + bias) largest first, divided by their sum when renorm."""
    fn = _fn("moe_softmax_topk")
    if fn is None or not (router_rows(w) and all(_host_rows(t) for t in (x, bias))):
        return None
    t, n = x.shape[0], w.shape[0]
    ids, weights = torch.empty(t, k, dtype=torch.int64), torch.empty(t, k, dtype=F32)
    ok = fn(_p(x), t, x.shape[1], _p(w), int(w.dtype is torch.bfloat16), _ptr(bias), n, k, int(renorm), _p(ids),
            _p(weights))
    return (weights, ids) if ok == 0 else None


def sigmoid_topk(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, k: int, groups: int, top_groups: int,
                 normalise: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """DeepSeek-V3's router (models/layers.sigmoid_group_topk) from x [T, E] and w [N, E]:
    (weights [T, k] fp32, ids [T, k] int64)."""
    fn = _fn("moe_sigmoid_topk")
    if fn is None or not (router_rows(w) and all(_host_fp32(t) and t.is_contiguous() for t in (x, bias))):
        return None
    t, n = x.shape[0], w.shape[0]
    ids, weights = torch.empty(t, k, dtype=torch.int64), torch.empty(t, k, dtype=F32)
    ok = fn(_p(x), t, x.shape[1], _p(w), int(w.dtype is torch.bfloat16), _p(bias), n, k, groups, top_groups,
            int(normalise), scale, _p(ids), _p(weights))
    return (weights, ids) if ok == 0 else None


class _StepWeights(ctypes.Structure):
    _fields_ = [("E", c_i64), ("H", c_i64), ("K", c_i64), ("D", c_i64), ("Dv", c_i64), ("quant", ctypes.c_int),
                ("group", c_i64), ("w", c_ptr), ("scales", c_ptr), ("bias", c_ptr), ("q_norm", c_ptr),
                ("k_norm", c_ptr), ("eps", c_f), ("scale", c_f), ("gated", ctypes.c_int), ("sinks", c_ptr),
                ("o_quant", ctypes.c_int), ("o_group", c_i64), ("O", c_i64), ("o_w", c_ptr), ("o_scales", c_ptr),
                ("o_bias", c_ptr), ("in_norm", c_ptr), ("post_norm", c_ptr)]


class AttentionStep:
    """One layer's attention for a decode step in one native call (step.h): the quantised qkv
    (parts "w", "w.scale" of `quant`), its bias, the QK-norm weights, the heads, made once. gated:
    each head's query rows are followed by its output gate's (Qwen3.5 / Next); sinks [H]: gpt-oss's.
    `out`: the output projection bound (kernels.BoundMatrix) with its bias, where the call takes it:
    the step then gives the sublayer's output (`projects`). `norms`: the layer's input and
    post-attention RMSNorm weights [E] (eps the model's, as the QK-norm's), with which a projecting
    step is also a block (`blocks`: the residual stream in, its sum with the sublayer's output and
    that sum's norm out). Each with the numbers of the calls it replaces."""

    def __init__(self, parts: dict, quant: str, heads: int, kv_heads: int, head_dim: int,
                 bias: torch.Tensor | None, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                 gated: bool = False, sinks: torch.Tensor | None = None, out=None,
                 out_bias: torch.Tensor | None = None, norms: tuple[torch.Tensor, torch.Tensor] | None = None):
        from moefit.kernels import Q, group_of, matrix_shape
        w, scale = parts["w"], parts["w.scale"]
        cols = matrix_shape(w, quant)[1]
        self.projects = out is not None and out.fn is not None and out.cols == heads * head_dim and \
            _host_fp32(out_bias) and (out_bias is None or out_bias.is_contiguous())
        _, o_rows, o_quant, o_group, o_w, o_scales = out.args if self.projects else (0, 0, 0, 0, None, None)
        self.blocks = self.projects and o_rows == cols and _block_norms(norms, cols)
        norms = norms if self.blocks else (None, None)
        self.keep = (w, scale, bias, q_norm, k_norm, sinks, *norms) + ((out.keep, out_bias) if self.projects else ())
        self.weights = _StepWeights(
            cols, heads, kv_heads, head_dim, head_dim, Q[quant], group_of(quant, cols, scale),
            w.data_ptr(), scale.data_ptr(), *(_ptr(t) for t in (bias, q_norm, k_norm)), eps, head_dim ** -0.5,
            int(gated), _ptr(sinks), o_quant, o_group, o_rows, o_w, o_scales, _ptr(out_bias) if self.projects else None,
            *(_ptr(t) for t in norms))
        self.width = o_rows if self.projects else heads * head_dim
        self.fn = _fn("moe_attention_step")
        self.usable = self.fn is not None and w.is_cpu and all(_host_fp32(t) for t in (bias, q_norm, k_norm, sinks))
        self.kv_pair = KvPair()

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows, block: bool = False):
        """x [1, E] of one position (cos, sin its RoPE rows); rows: the state's step_rows (k and v as
        StoredRows over every slot, of any codec; the slot to write, the runs of slots to attend)
        -> [1, H*Dv], or [1, O] where it `projects`; or None. As a `block` (where it `blocks`), x is
        the residual stream before the layer's input norm -> (x + the sublayer's output, that sum's
        post-attention norm), each [1, E]."""
        if not self.usable or not (_host_fp32(x) and x.is_contiguous()) or block and not self.blocks:
            return None
        k, v, slot, runs = rows
        described = self.kv_pair(k, v)
        if described is None:
            return None
        kr, vr = described
        spans = (ctypes.c_int64 * (2 * len(runs)))(*(n for run in runs for n in run))
        while True:
            out = torch.empty(1, self.width, dtype=F32)
            h = torch.empty(1, self.width, dtype=F32) if block else None
            ok = self.fn(ctypes.byref(self.weights), _p(x), _p(cos), _p(sin), cos.shape[-1], ctypes.byref(kr),
                         ctypes.byref(vr), slot, spans, len(runs), _p(out), _ptr(h))
            if ok == 0:
                return (out, h) if block else out
            if not self.projects:
                return None
            self._without_projection()           # refused before writing: perhaps the projection's shape
            if block:
                return None

    def _without_projection(self) -> None:
        """From now on the heads' output, the caller projecting it (a projection moe_linear does not
        take), and no block."""
        self.projects, self.blocks, self.width = False, False, self.weights.H * self.weights.Dv
        self.weights.o_w = None


class _DeltaWeights(ctypes.Structure):
    _fields_ = [("hk", c_i64), ("hv", c_i64), ("dk", c_i64), ("dv", c_i64), ("kernel", c_i64), ("conv_w", c_ptr),
                ("a_log", c_ptr), ("dt_bias", c_ptr), ("norm_w", c_ptr), ("eps", c_f)]


class _DeltaBlock(ctypes.Structure):
    _fields_ = [("E", c_i64), ("P", c_i64), ("in_quant", ctypes.c_int), ("out_quant", ctypes.c_int),
                ("in_group", c_i64), ("out_group", c_i64), ("in_w", c_ptr), ("in_scales", c_ptr), ("out_w", c_ptr),
                ("out_scales", c_ptr), ("in_norm", c_ptr), ("post_norm", c_ptr), ("eps", c_f)]


class DeltaStep:
    """One Gated DeltaNet layer's decode step in one native call (delta.h): from in_proj's output
    to out_proj's input, the conv window and the recurrent state updated in place. Made once per
    layer from its weights (conv [C, 1, K], A_log, dt_bias [Hv], the gated norm's [Dv]). With
    `sublayer` (in_proj and out_proj bound, kernels.BoundMatrix; the layer's input and post-attention
    norms [E]; the model's eps) where the call takes them, it is also a block (`blocks`): the
    residual stream in, its sum with the sublayer's output and that sum's norm out."""

    def __init__(self, dims: tuple[int, int, int, int, int], conv: torch.Tensor, a_log: torch.Tensor,
                 dt_bias: torch.Tensor, norm: torch.Tensor, eps: float, sublayer: tuple | None = None):
        hk, hv, dk, dv, kernel = dims
        self.keep = (conv, a_log, dt_bias, norm)                  # the addresses below stay theirs
        self.weights = _DeltaWeights(hk, hv, dk, dv, kernel, *(t.data_ptr() for t in self.keep), eps)
        self.fn = _fn("moe_delta_step")
        self.usable = self.fn is not None and all(_host_fp32(t) and t.is_contiguous() for t in self.keep)
        self.blocks, self.block_fn = False, _fn("moe_delta_block")
        if sublayer is not None and self.usable and self.block_fn is not None:
            self._bind_block(*sublayer)

    def _bind_block(self, in_proj, out, in_norm: torch.Tensor, post_norm: torch.Tensor, eps: float) -> None:
        w = self.weights
        width, e = 2 * w.hk * w.dk + w.hv * w.dv + w.hv * w.dv + 2 * w.hv, in_proj.cols
        if not (in_proj.fn and out.fn and in_proj.rows == width and out.cols == w.hv * w.dv and out.rows == e
                and _block_norms((in_norm, post_norm), e)):
            return
        (_, _, in_quant, in_group, in_w, in_scales), (_, _, out_quant, out_group, out_w, out_scales) = in_proj.args, out.args
        self.block = _DeltaBlock(e, width, in_quant, out_quant, in_group, out_group, in_w, in_scales, out_w, out_scales,
                                 _p(in_norm), _p(post_norm), eps)
        self.keep += (in_proj.keep, out.keep, in_norm, post_norm)
        self.blocks = True

    def takes(self, *tensors: torch.Tensor) -> bool:
        """Whether a call on these (in_proj's output rows, the conv window, the state) computes."""
        return self.usable and all(_host_fp32(t) and t.is_contiguous() for t in tensors)

    def __call__(self, proj: torch.Tensor, conv_state: torch.Tensor, s: torch.Tensor) -> torch.Tensor | None:
        """proj [1, C + Hv Dv + 2 Hv] -> [1, Hv Dv]; conv_state [C, K-1] and s [Hv, Dk, Dv] updated.
        None where it does not apply (then nothing was changed)."""
        return self.run(proj, conv_state, s) if self.takes(proj, conv_state, s) else None

    def run(self, proj: torch.Tensor, conv_state: torch.Tensor, s: torch.Tensor) -> torch.Tensor | None:
        """__call__ on tensors takes() has accepted (a window's tokens: checked once, not each)."""
        out = torch.empty(1, self.weights.hv * self.weights.dv, dtype=F32)
        ok = self.fn(ctypes.byref(self.weights), _p(proj), _p(conv_state), _p(s), _p(out))
        return out if ok == 0 else None

    def block_run(self, x: torch.Tensor, conv_state: torch.Tensor, s: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """As a block (where it `blocks`; takes() accepted x, the window and the state): x [1, E]
        the residual stream -> (x + the sublayer's output, that sum's post-attention norm), each
        [1, E]; the window and the state updated. None where the call refuses (nothing changed)."""
        out, h = torch.empty_like(x, memory_format=CONTIGUOUS), torch.empty_like(x, memory_format=CONTIGUOUS)
        ok = self.block_fn(ctypes.byref(self.weights), ctypes.byref(self.block), _p(x), _p(conv_state), _p(s), _p(out),
                           _p(h))
        if ok != 0:
            self.blocks = False
        return (out, h) if ok == 0 else None

"""Attention over the sequence state, every family's: the causal mask, one contiguous part by
SDPA (host rows read as stored by kernels/kv.h where it takes them), a ring or a ring and its
host part merged by log-sum-exp. models/layers.py holds the rest of what families share.

Legend: T tokens in this forward, S keys attended (start + T), H query heads,
K key/value heads, D head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moefit.kernels import rows as native
from moefit.runtime.kv_codecs import StoredRows


def causal_mask(start: int, t: int, window: int | None, device) -> torch.Tensor | None:
    """Boolean [T, S] mask (True = attend) for a chunk at absolute positions start..start+T."""
    if t == 1 and window is None:
        return None
    q = torch.arange(start, start + t, device=device)[:, None]
    k = torch.arange(start + t, device=device)[None, :]
    allowed = k <= q
    if window is not None:
        allowed &= (q - k) < window
    return allowed


def attend_state(state, i: int, q: torch.Tensor, start: int, mask: torch.Tensor | None,
                 scale: float | None = None, keys=None, sinks: torch.Tensor | None = None,
                 turned: bool = True) -> torch.Tensor:
    """q [H, T, D] (positions start..start+T) against layer i's keys 0..start+T as the
    sequence state holds them (runtime/state.py) -> [T, H*Dv]. One contiguous part is a decode
    step read as stored (kernels/kv.h), a short forward's keys before it so too and its own rows
    by torch (_prefix_and_own), else SDPA with `mask`; a ring, or a ring and its host part, are
    merged by log-sum-exp. `scale` overrides 1/sqrt(D); `keys(k, v) -> (k, v)` builds the
    attended rows from the stored ones (MLA keeps a latent and a rope key per token). `sinks` [H]
    (gpt-oss) are logits of a virtual key with a zero value in every head's softmax: they scale
    the output by sigmoid(lse - sink). `turned` False: the caller turns q and the output for rows
    stored rotated (MLA, whose keys are two stores). A recorded piece's view (runtime/decode_graphs.py,
    `recorded`) gives its rows and the mask the device made instead (_recorded_attention)."""
    t = q.shape[1]
    rk, rv = state.rotations(i) if turned else (None, None)
    if rk is not None:
        q = turn(q, rk)
    if getattr(state, "recorded", False):
        out = _recorded_attention(state, i, q, mask, scale, keys, sinks)
    else:
        out = _state_attention(state, i, q, start, mask, scale, keys, sinks)
    if rv is not None:
        out = turn(out, rv, back=True)
    return out.transpose(0, 1).reshape(t, -1)


def _state_attention(state, i: int, q: torch.Tensor, start: int, mask: torch.Tensor | None, scale: float | None,
                     keys, sinks: torch.Tensor | None) -> torch.Tensor:
    """attend_state's parts as the sequence state holds them -> [H, T, Dv] (its docstring)."""
    t = q.shape[1]
    read = _recent_attention(state, i, q, start, scale) if sinks is not None and t == 1 else None
    parts = state.parts(i, start + t, stored=keys is None) if read is None else None
    if keys is not None:
        parts = [(*keys(k, v), pos) for k, v, pos in parts]
    if parts and state.own_window(i) and parts[0][2] is None:      # this layer's own window, not the shared mask
        mask = causal_mask(start, t, state.window(i), q.device)
    if parts and _splits(parts, start, t, state.window(i)):
        parts = _prefix_and_own(parts[0], start, t, q.dtype)
    if sinks is not None:
        if read is None:
            pos = [p if p is not None else torch.arange(_length(k)) for k, _, p in parts]
            read = attend_parts(q, [(k, v, p) for (k, v, _), p in zip(parts, pos)], torch.arange(start, start + t),
                                state.window(i), scale, with_lse=True)
        out, lse = read
        out = out * torch.sigmoid(lse - sinks.float()[:, None, None]).to(out.dtype)
    elif len(parts) == 1 and parts[0][2] is None:
        k, v, _ = parts[0]
        whole = _stored_attention(q, k, v, scale) if mask is None else None
        out = whole[0].to(q.dtype) if whole is not None else sdpa(q, *_decoded(k, v, q.dtype), mask, scale)
    else:
        q_pos = torch.arange(start, start + t)
        out = attend_parts(q, parts, q_pos, state.window(i), scale)
    return out


def _recorded_attention(view, i: int, q: torch.Tensor, mask: torch.Tensor, scale: float | None, keys,
                        sinks: torch.Tensor | None) -> torch.Tensor:
    """A recorded piece's attention (runtime/decode_graphs.BucketView): the layer's rows under the
    mask the device made (`attended`); nothing here waits for the device -> [H, T, Dv]."""
    k, v, allowed = view.attended(i, mask)
    if keys is not None:
        k, v = keys(k, v)
    if sinks is None:
        return sdpa(q, k, v, allowed, scale)
    h, t, d = q.shape
    kh = k.shape[0]
    out, lse = _part_attention(q.reshape(kh, h // kh * t, d), k, v, allowed.repeat(h // kh, 1),
                               scale or d ** -0.5, waits=False)
    out, lse = out.reshape(h, t, -1).to(q.dtype), lse.reshape(h, t, 1)
    return out * torch.sigmoid(lse - sinks.float()[:, None, None]).to(out.dtype)


def turn(x: torch.Tensor, rotation: torch.Tensor, back: bool = False) -> torch.Tensor:
    """x @ rotation (back: its transpose), q4's turn of a query or an output [H, T, D]: a decode
    step's on the host by the native step's own loop (kernels/step.h), so a step taken op by op
    sums as the one call does; a prompt's by torch."""
    turned = native.turn_rows(x, rotation, back) if x.shape[-2] == 1 else None
    if turned is not None:
        return turned
    r = rotation.to(device=x.device, dtype=x.dtype)
    return x @ (r.T if back else r)


def attend_latent(state, i: int, q: torch.Tensor, start: int, scale: float) -> torch.Tensor | None:
    """MLA's decode step read as stored (kernels/kv.h's moe_attend_latent): q [H, 1, r + dr] (the
    absorbed nope query, then the rope query) against layer i's rope keys and latents, one
    contiguous part in host memory -> [1, H*r]; None where the kernel does not take it (a card's
    memory, KV streaming's parts, a forward of several tokens): attend_state, then."""
    h, t, d = q.shape
    if t != 1:
        return None
    parts = state.parts(i, start + t, stored=True)
    if len(parts) != 1 or parts[0][2] is not None:
        return None
    k, v, _ = parts[0]
    if not (_reads_natively(k, t) and _reads_natively(v, t)) or k.codec.d + v.codec.d != d:
        return None
    res = native.attend_stored(q.reshape(1, h, d), k, v, scale, latent=True)
    return None if res is None else res[0].to(device=q.device, dtype=q.dtype).reshape(t, -1)


def _recent_attention(state, i: int, q: torch.Tensor, start: int, scale: float | None):
    """A decode step's attention with its log-sum-exp (gpt-oss's sinks need it) over the rows it
    attends read in place by kernels/kv.h: the context, or a sliding window's positions in its
    ring (one run of slots or two, merged by log-sum-exp) -> (out [H, 1, Dv] in q's dtype, lse
    [H, 1, 1]), or None where they are not host rows the kernel reads (then attend_parts)."""
    runs = state.recent_rows(i, start + 1)
    if runs is None:
        return None
    out = lse = None
    for k, v in runs:
        part = _stored_attention(q, k, v, scale) if _reads_natively(k, 1) else None
        if part is None:
            return None
        out, lse = _merge(out, lse, *part)
    return out.to(q.dtype), lse


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
         scale: float | None) -> torch.Tensor:
    """q [H, T, D] against one contiguous part k, v [K, S, D] -> [H, T, Dv]. On CUDA a masked
    grouped-query prefill would fall to the math kernel, which materialises [H, T, S] scores
    (GiBs at 32K, more than the prompt-path line holds): there the KV heads are expanded (a
    [H, S, D] copy, one layer at a time) and the memory-efficient kernel takes the mask."""
    gqa = q.shape[0] != k.shape[0]
    if mask is None and q.shape[1] == 1 and (out := native.attend_one(q, k, v, scale)) is not None:
        return out                                            # a decode step on the host
    if gqa and mask is None and q.device.type == "cpu":      # a decode step: each kv head's query heads as rows
        h, t, d = q.shape                                     # (half the time of enable_gqa on the host)
        out = F.scaled_dot_product_attention(q.reshape(k.shape[0], h // k.shape[0] * t, d)[None], k[None], v[None],
                                             scale=scale)[0]
        return out.reshape(h, t, -1)
    if gqa and mask is not None and q.shape[1] <= SPLIT_TOKENS:   # a few positions under a mask (a verify window,
        return _rows_per_kv_head(q, k, v, mask, scale)               # a recorded step's bucket): no [H, S, D] copy
    if q.device.type == "cuda" and mask is not None:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        if gqa:
            k, v = (x.repeat_interleave(q.shape[0] // x.shape[0], dim=0) for x in (k, v))
            gqa = False
        try:
            with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
                return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, scale=scale)[0]
        except RuntimeError:                   # a shape the kernel does not take: the default choice
            pass
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, enable_gqa=gqa, scale=scale)[0]


KEY_BLOCK = 4096


def attend_parts(q: torch.Tensor, parts, q_pos: torch.Tensor, window: int | None,
                 scale: float | None = None, with_lse: bool = False):
    """Exact softmax attention over several key parts, each where it lives: every part gives
    its output and log-sum-exp, and the parts are merged by their log-sum-exp (the flash-
    attention recurrence). q [H, T, D], parts [(k [K, S, D], v [K, S, Dv], positions [S])]
    -> [H, T, Dv] in q's dtype."""
    h, t, d = q.shape
    kh = _heads(parts[0][0])
    g = h // kh
    out = lse = None
    for k, v, pos in parts:
        qg = q.to(k.device).reshape(kh, g * t, d)                 # a kv head's query heads together: [K, gT, D]
        qp = q_pos.to(k.device).repeat(g)                          # [gT]
        allowed = None
        if window is not None or int(pos.max()) > int(q_pos.min()):
            allowed = pos[None, :] <= qp[:, None]
            if window is not None:
                allowed &= (qp[:, None] - pos[None, :]) < window
        native = _stored_attention(q, k, v, scale) if allowed is None else None
        if native is not None:
            o, m = (x.reshape(kh, g * t, -1) for x in native)
        else:
            o, m = _part_attention(qg, *_decoded(k, v, q.dtype), allowed, scale or d ** -0.5)
        out, lse = _merge(out, lse, o.to(q.device), m.to(q.device))
    out = out.reshape(h, t, -1).to(q.dtype)
    return (out, lse.reshape(h, t, 1)) if with_lse else out


SPLIT_TOKENS = 16       # a forward of at most this many tokens reads the keys before it as stored


def _rows_per_kv_head(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      scale: float | None) -> torch.Tensor:
    """Grouped-query attention of a few positions as one kv head's query heads x positions in
    rows (q [H, T, D] -> [K, G T, D], row g T + t), the mask [T, S] repeated for each of G."""
    h, t, d = q.shape
    g = h // k.shape[0]
    out = F.scaled_dot_product_attention(q.reshape(k.shape[0], g * t, d)[None], k[None], v[None],
                                         attn_mask=mask.repeat(g, 1) if t > 1 else mask, scale=scale)[0]
    return out.reshape(h, t, -1)


def _splits(parts, start: int, t: int, window: int | None) -> bool:
    """Whether a short forward's (a verify window's, a draft's) whole-context part is better
    attended as two (_prefix_and_own): stored host rows, plain causal attention, keys before it."""
    return (len(parts) == 1 and parts[0][2] is None and _reads_natively(parts[0][0], t) and
            parts[0][0].device.type == "cpu" and window is None and 1 < t <= SPLIT_TOKENS and start > 0)


def _reads_natively(k, t: int) -> bool:
    """Whether kv.h takes these rows for t query positions: stored rows, but for fp32 ones past one
    position (torch's flash kernel multiplies several positions' rows faster, and an fp32 part's
    "decoded" rows are a view: bench/results/kv_attention-round15-avx2.txt, 0.6-1.0x at 4)."""
    return isinstance(k, StoredRows) and (t == 1 or k.codec.native != 0)


def _prefix_and_own(part, start: int, t: int, dtype: torch.dtype) -> list:
    """The whole context's part of a forward at start..start+t as two parts: the keys before it,
    which every query attends (read as stored by the native kernel, no mask), and its own t rows,
    decoded and causally masked by attend_parts; merged by log-sum-exp. Decoding the whole part
    for torch instead cost a verify window what a decode step cost before kernels/kv.h."""
    k, v, _ = part
    return [(k.first(start), v.first(start), torch.arange(start)),
            (k.decode(dtype, start), v.decode(dtype, start), torch.arange(start, start + t))]


def _stored_attention(q: torch.Tensor, k, v, scale: float | None):
    """q [H, T, D] against every row of a part held as stored (StoredRows in host memory), by
    kernels/kv.h without decoding it -> (out [H, T, Dv], log-sum-exp [H, T, 1]), fp32 on q's
    device, or None where the kernel does not take it (decoded tensors, a card's memory)."""
    h, t, d = q.shape
    if not _reads_natively(k, t):
        return None
    kh = _heads(k)
    res = native.attend_stored(q.reshape(kh, h // kh * t, d), k, v, d ** -0.5 if scale is None else scale)
    if res is None:
        return None
    out, lse = res
    return out.reshape(h, t, -1).to(q.device), lse.reshape(h, t, 1).to(q.device)


def _decoded(k, v, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return (k.decode(dtype), v.decode(dtype)) if isinstance(k, StoredRows) else (k, v)


def _length(k) -> int:
    return k.count if isinstance(k, StoredRows) else k.shape[1]


def _heads(k) -> int:
    return k.store["x"].shape[0] if isinstance(k, StoredRows) else k.shape[0]


def _part_attention(q, k, v, allowed, scale: float, waits: bool = True):
    """(out [K, gT, Dv] fp32, log-sum-exp [K, gT, 1]) of q against one part; CPU uses torch's
    fused flash kernel, which returns the log-sum-exp (it needs keys and values of one width, and
    a look at the mask: not `waits` in a recorded piece), other cases a blockwise softmax."""
    fused = waits and k.device.type == "cpu" and k.shape[-1] == v.shape[-1]
    if fused and (allowed is None or bool(allowed.any(dim=-1).all())):
        mask = None if allowed is None else torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))
        o, m = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.float()[None], k.float()[None], v.float()[None], 0.0, False, attn_mask=mask, scale=scale)[:2]
        return o[0], m[0].unsqueeze(-1)
    out = lse = None
    for b in range(0, k.shape[1], KEY_BLOCK):
        s = (q.float() @ k[:, b:b + KEY_BLOCK].float().transpose(1, 2)) * scale                 # [K, gT, Sb]
        if allowed is not None:
            s = s.masked_fill(~allowed[:, b:b + KEY_BLOCK], float("-inf"))
        m = torch.logsumexp(s, dim=-1, keepdim=True)
        p = torch.exp(s - torch.where(torch.isinf(m), torch.zeros_like(m), m))
        out, lse = _merge(out, lse, p @ v[:, b:b + KEY_BLOCK].float(), m)
    return out, lse


def _merge(out, lse, o, m):
    """Two normalised partial attentions (out, log-sum-exp) -> their exact combination."""
    if out is None:
        return o, m
    top = torch.maximum(lse, m)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    a, b = torch.exp(lse - top), torch.exp(m - top)
    total = a + b
    return (out * a + o * b) / total.clamp(min=1e-30), torch.log(total) + top

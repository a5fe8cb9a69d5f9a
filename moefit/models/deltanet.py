"""Gated DeltaNet (Yang, Kautz, Hatamizadeh 2024), the linear-attention layer of Qwen3-Next and
Qwen3.5 / 3.6-MoE, as primitives shared by those families (like models/layers.py).

Per value head, the state S [Dk, Dv] is a fast-weight memory. For each token, with decay
a_t = exp(g_t) and learning rate beta_t:

    S_t = a_t S_{t-1} + k_t (beta_t (v_t - a_t S_{t-1}^T k_t))^T      (decay, then the delta rule)
    o_t = S_t^T q_t

`recurrent` runs that loop (decode, and verify windows); `chunked` is the same recurrence in
chunks of C tokens (prefill): inside a chunk the delta-rule updates are solved at once as a
unit-lower-triangular system (the UT transform), and only the chunk boundaries are sequential.
The state stays fp32. Legend: T tokens, H value heads, Dk / Dv key / value head dims.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64
NEGLIGIBLE = -60.0      # log-decays below this are taken as 0 (e^-60 ~ 1e-26; see decay_exp)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def causal_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv + SiLU over x [T, C] continuing from `state` [C, K-1] (the last
    K-1 inputs), which is updated in place; weight [C, 1, K]."""
    k = weight.shape[-1]
    seq = torch.cat((state, x.T.to(state.dtype)), dim=1)                           # [C, K-1+T]
    state.copy_(seq[:, -(k - 1):])
    y = F.conv1d(seq[None].to(weight.dtype), weight, groups=seq.shape[0])[0]      # [C, T]
    return F.silu(y).T.to(x.dtype)


def recurrent(q, k, v, g, beta, s: torch.Tensor, after=None) -> torch.Tensor:
    """q, k [H, T, Dk], v [H, T, Dv], g, beta [H, T] (fp32, q already scaled); s [H, Dk, Dv]
    updated in place -> o [H, T, Dv]. after(t), if given, is called once s holds positions
    0..t, for every t but the last (a verify window's checkpoints)."""
    out = torch.empty_like(v)
    for t in range(q.shape[1]):
        if after is not None and t > 0:
            after(t - 1)
        s.mul_(g[:, t].exp()[:, None, None])
        predicted = torch.einsum("hkv,hk->hv", s, k[:, t])
        delta = (v[:, t] - predicted) * beta[:, t, None]
        s.add_(k[:, t, :, None] * delta[:, None, :])
        out[:, t] = torch.einsum("hkv,hk->hv", s, q[:, t])
    return out


def decay_exp(log_decay: torch.Tensor) -> torch.Tensor:
    """exp of log-decays, those below NEGLIGIBLE exactly 0. A strongly decaying head's factors
    otherwise reach fp32's subnormal range (below e^-87), inside the matrix products too, where
    every subnormal operand or result costs a microcode assist: measured at Qwen3.6's shape (32
    heads, 512 tokens), a head decaying by up to e^-7 a token made the chunked form 4x slower
    (88 -> 356 ms). What is dropped is below 1e-26 of the terms it is summed with."""
    return log_decay.masked_fill(log_decay < NEGLIGIBLE, float("-inf")).exp()


def chunked(q, k, v, g, beta, s: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """The same as `recurrent`, C tokens at a time."""
    h, t, _ = q.shape
    pad = -t % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (t + pad) // chunk
    q, k, v = (x.view(h, n, chunk, -1) for x in (q, k, v))
    g, beta = g.view(h, n, chunk), beta.view(h, n, chunk)
    decay = g.cumsum(dim=-1)                                                        # log a_1..a_i in a chunk
    later = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    pair = decay_exp((decay[..., :, None] - decay[..., None, :]).masked_fill(later, float("-inf")))   # [H, N, C, C]
    kb, vb = k * beta[..., None], v * beta[..., None]
    # (I + strictly-lower(beta K K^T * decay)) U = beta V: unitriangular reads only the strict lower part.
    # Its inverse once (C right-hand sides), then two batched products: the two solves with Dv and
    # Dk right-hand sides took 34 ms, this 18, at Qwen3.6's 32 heads x 512 tokens (2 threads).
    system = (kb @ k.transpose(-1, -2)) * pair
    eye = torch.eye(chunk, dtype=system.dtype, device=system.device).expand_as(system)
    inverse = torch.linalg.solve_triangular(system, eye, upper=False, unitriangular=True)
    u = inverse @ vb                                                                 # new values
    w = inverse @ (kb * decay_exp(decay)[..., None])
    scores = (q @ k.transpose(-1, -2)) * pair                                        # causal, incl. the diagonal
    q_dec = q * decay_exp(decay)[..., None]
    k_dec = k * decay_exp(decay[..., -1:] - decay)[..., None]
    out = torch.empty_like(u)
    for i in range(n):
        v_new = u[:, i] - w[:, i] @ s
        out[:, i] = q_dec[:, i] @ s + scores[:, i] @ v_new
        s.mul_(decay_exp(decay[:, i, -1])[:, None, None]).add_(k_dec[:, i].transpose(-1, -2) @ v_new)
    return out.reshape(h, n * chunk, -1)[:, :t]

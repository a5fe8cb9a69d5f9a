"""Rotary position embeddings, as every family's reference computes them: the cos / sin rows of a
forward's positions (RopeTable, from the inverse frequencies: default, linear, YaRN), rotate-half
RoPE, DeepSeek's interleaved pairs, and a partial rotation (the first channels of each head).
"""

from __future__ import annotations

import math

import torch


class RopeTable:
    """cos / sin rows for the positions of each forward, computed from the inverse frequencies
    (a few hundred bytes on the device instead of a [ctx, D] table: 64 MiB at 131K)."""

    def __init__(self, rope: dict, head_dim: int, max_position_embeddings: int, device, dtype: torch.dtype):
        inv_freq, self.scale = rope_inv_freq(rope, head_dim, max_position_embeddings)
        self.inv_freq, self.dtype = inv_freq.to(device), dtype

    def rows(self, start: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, D] for positions start..start+T (fp32 angles, as the reference's table)."""
        return self.at(torch.arange(start, start + t, device=self.inv_freq.device))

    def at(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, D] for the positions a tensor holds (a recorded decode step reads them from
        the device: runtime/decode_graphs.py)."""
        freqs = pos.float()[:, None] * self.inv_freq[None, :]                         # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)                                      # [T, D]
        return (emb.cos() * self.scale).to(self.dtype), (emb.sin() * self.scale).to(self.dtype)

    def nbytes(self) -> int:
        return self.inv_freq.nbytes


def rope_inv_freq(rope: dict, dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    kind = rope.get("rope_type", "default")
    base = rope.get("rope_theta", 10000.0)
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / rope["factor"], 1.0
    if kind == "yarn":
        return _yarn(rope, dim, base, max_position_embeddings)
    raise ValueError(f"rope type {kind!r} is not supported (default, linear, yarn)")


def yarn_mscale(scale: float, m: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched by `scale`."""
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _yarn(rope: dict, dim: int, base: float, max_pos: int) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al. 2023): interpolate low frequencies, keep high ones, with a
    linear ramp between; cos/sin are scaled by the attention factor."""
    factor = rope["factor"]
    orig = rope.get("original_max_position_embeddings") or max_pos
    attn = rope.get("attention_factor")
    if attn is None:
        m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attn = yarn_mscale(factor, m) / yarn_mscale(factor, m_all) if m and m_all else yarn_mscale(factor)
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1
    corr = lambda rot: dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))  # noqa: E731
    low, high = corr(beta_fast), corr(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attn)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, T, D] rotated by position; cos, sin [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on channel pairs (x0, x1), (x2, x3), ... (DeepSeek's layout), written out
    de-interleaved (all first halves, then all second halves), as the reference does."""
    half = cos.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first cos.shape[-1] channels of each head, the rest passed through
    (partial_rotary_factor: GLM-4.5, Qwen3-Next)."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return apply_rope(x, cos, sin)
    return torch.cat((apply_rope(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)

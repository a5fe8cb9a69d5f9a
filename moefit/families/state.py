"""Sequence state, declared per layer without torch: what one session keeps between
forwards, and what it costs. `memory/footprint` and the planner read these; `runtime/state`
builds one state object per declaration.

    AttentionKV     keys and values per token (GQA; `window` = sliding attention, which
                    holds at most window + one prefill chunk of tokens)
    LatentKV        MLA: one compressed latent [rank] and one shared rope key [rope_dim]
                    per token (DeepSeek-V3)
    RecurrentState  Gated DeltaNet: a [heads, k_dim, v_dim] fp32 state and the causal
                    conv's last (kernel - 1) inputs, and a snapshot of both: constant in
                    the context length

KV dtypes (bytes of a row of n values): fp32 4n, fp16 / bf16 2n, int8 n + a fp32 scale,
q4 n/2 + a fp16 scale per 32 (Hadamard-rotated rows), k8v4 = keys int8, values q4.
"""

from __future__ import annotations

from dataclasses import dataclass

KV_DTYPES = ("fp32", "fp16", "bf16", "int8", "q4", "k8v4")
Q4_GROUP = 32
FLOAT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


def split_kv_dtype(kv_dtype: str) -> tuple[str, str]:
    """(key dtype, value dtype): k8v4 mixes; every other KV dtype is the same for both."""
    return ("int8", "q4") if kv_dtype == "k8v4" else (kv_dtype, kv_dtype)


def row_bytes(n: int, dtype: str) -> int:
    """Bytes of one stored row of n values (one head of one token)."""
    if dtype == "int8":
        return n + 4
    if dtype == "q4":
        return n // 2 + 2 * (n // Q4_GROUP)
    return n * FLOAT_BYTES[dtype]


@dataclass(frozen=True)
class AttentionKV:
    kv_heads: int
    head_dim: int
    v_head_dim: int
    window: int | None = None

    kind = "attention"

    def tokens_held(self, ctx: int, chunk: int) -> int:
        return ctx if self.window is None else min(ctx, self.window + chunk)

    def bytes_per_token(self, kv_dtype: str) -> int:
        k, v = split_kv_dtype(kv_dtype)
        return self.kv_heads * (row_bytes(self.head_dim, k) + row_bytes(self.v_head_dim, v))

    def constant_bytes(self, compute_bytes: int) -> int:
        return 0

    @property
    def streams(self) -> bool:
        """Grows with the context, so its older part may live on the host (KV streaming)."""
        return self.window is None


@dataclass(frozen=True)
class LatentKV:
    rank: int
    rope_dim: int
    window = None

    kind = "latent"

    def tokens_held(self, ctx: int, chunk: int) -> int:
        return ctx

    def bytes_per_token(self, kv_dtype: str) -> int:
        k, v = split_kv_dtype(kv_dtype)
        return row_bytes(self.rope_dim, k) + row_bytes(self.rank, v)

    def constant_bytes(self, compute_bytes: int) -> int:
        return 0

    streams = True


PROMPT_MARKS = 2        # prompt ends whose recurrent state a session keeps in host memory (runtime/state.py)


@dataclass(frozen=True)
class RecurrentState:
    heads: int
    k_dim: int
    v_dim: int
    conv_channels: int
    conv_kernel: int
    window = None

    kind = "recurrent"

    def tokens_held(self, ctx: int, chunk: int) -> int:
        return 0

    def bytes_per_token(self, kv_dtype: str) -> int:
        return 0

    def constant_bytes(self, compute_bytes: int) -> int:
        """The state and the conv window, twice: the second copy is the snapshot taken at the start
        of each multi-token forward, which a rejected speculative window or a reused prefix
        resumes from (runtime/state.py)."""
        return 2 * (self.recurrent_bytes() + compute_bytes * self.conv_channels * (self.conv_kernel - 1))

    def recurrent_bytes(self) -> int:
        """The fp32 state matrix alone: what a verify window checkpoints per position."""
        return 4 * self.heads * self.k_dim * self.v_dim

    streams = False


LayerState = AttentionKV | LatentKV | RecurrentState


def layer_bytes(s: LayerState, ctx: int, kv_dtype: str, compute_bytes: int, chunk: int,
                resident: int | None = None) -> int:
    """Device bytes of one layer's state for one session; with a resident window, a
    streaming layer keeps only its most recent `resident` tokens on the card."""
    tokens = s.tokens_held(ctx, chunk)
    if resident is not None and s.streams:
        tokens = min(tokens, resident)
    return tokens * s.bytes_per_token(kv_dtype) + s.constant_bytes(compute_bytes)

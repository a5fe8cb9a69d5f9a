"""Qwen3-MoE: GQA with per-head QK-norm, softmax top-k router, optional dense-MLP layers."""

from moefit.families import common as c
from moefit.families.state import AttentionKV

NAME = "qwen3_moe"
RUNS = True


def moe_layers(cfg: dict, layers: int) -> tuple[int, ...]:
    return c.sparse_step(cfg, layers)


def layer_states(m) -> list:
    return [AttentionKV(m.num_kv_heads, m.head_dim, m.head_dim, m.sliding_window) for _ in range(m.num_layers)]


def dense_shapes(m) -> c.Shapes:
    shapes = c.outer(m)
    for i in range(m.num_layers):
        shapes |= c.norms(i, m.hidden_size)
        shapes |= c.gqa(i, m, bias=bool(m.raw.get("attention_bias")), qk_norm=(m.head_dim, m.head_dim))
        shapes |= c.router(i, m) if i in m.moe_layers else c.dense_mlp(i, m)
    return shapes

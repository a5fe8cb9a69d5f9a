"""Mixtral: GQA without QK-norm, a softmax top-2 router always renormalised; every layer MoE.
Its runtime keeps the whole context even with a sliding window (masked), so the state is
declared full-length."""

from moefit.families import common as c
from moefit.families.state import AttentionKV

NAME = "mixtral"
RUNS = True


def moe_layers(cfg: dict, layers: int) -> tuple[int, ...]:
    return tuple(range(layers))


def layer_states(m) -> list:
    return [AttentionKV(m.num_kv_heads, m.head_dim, m.head_dim) for _ in range(m.num_layers)]


def dense_shapes(m) -> c.Shapes:
    shapes = c.outer(m)
    for i in range(m.num_layers):
        shapes |= c.norms(i, m.hidden_size) | c.gqa(i, m) | c.router(i, m)
    return shapes

"""OLMoE: GQA with QK-norm over the whole projection (H*D, K*D); every layer MoE."""

from moefit.families import common as c
from moefit.families.state import AttentionKV

NAME = "olmoe"
RUNS = True


def moe_layers(cfg: dict, layers: int) -> tuple[int, ...]:
    return tuple(range(layers))


def layer_states(m) -> list:
    return [AttentionKV(m.num_kv_heads, m.head_dim, m.head_dim) for _ in range(m.num_layers)]


def dense_shapes(m) -> c.Shapes:
    shapes = c.outer(m)
    qk = (m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim)
    for i in range(m.num_layers):
        shapes |= c.norms(i, m.hidden_size) | c.gqa(i, m, qk_norm=qk) | c.router(i, m)
    return shapes

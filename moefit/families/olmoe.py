"""OLMoE: GQA with QK-norm over the whole projection (H*D, K*D); every layer MoE."""

from moefit.families import common as c

NAME = "olmoe"
RUNS = True


moe_layers = c.every_layer
layer_states = c.full_gqa


def dense_shapes(m) -> c.Shapes:
    shapes = c.outer(m)
    qk = (m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim)
    for i in range(m.num_layers):
        shapes |= c.norms(i, m.hidden_size) | c.gqa(i, m, qk_norm=qk) | c.router(i, m)
    return shapes

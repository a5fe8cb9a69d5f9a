"""Mixtral: GQA without QK-norm, a softmax top-2 router always renormalised; every layer MoE.
Its runtime keeps the whole context even with a sliding window (masked), so the state is
declared full-length."""

from moefit.families import common as c

NAME = "mixtral"
RUNS = True


moe_layers = c.every_layer
layer_states = c.full_gqa


def dense_shapes(m) -> c.Shapes:
    shapes = c.outer(m)
    for i in range(m.num_layers):
        shapes |= c.norms(i, m.hidden_size) | c.gqa(i, m) | c.router(i, m)
    return shapes

"""Qwen3.5 / Qwen3.6-MoE: Qwen3-Next's hybrid stack (three Gated DeltaNet layers to one
gated full-attention layer, shared expert), with the DeltaNet input projections split
(in_proj_qkv, in_proj_z, in_proj_b, in_proj_a) and an MTP layer. The multimodal
checkpoint nests the text model's config under `text_config` and its weights under
`model.language_model.*`."""

from moefit.families import common as c
from moefit.families import qwen3_next

NAME = "qwen3_5_moe"
RUNS = True

moe_layers = qwen3_next.moe_layers
layer_states = qwen3_next.layer_states
MTP, mtp_shapes, mtp_state = qwen3_next.MTP, qwen3_next.mtp_shapes, qwen3_next.mtp_state
mtp_layers = c.mtp_count


def linear_attention(i: int, m) -> c.Shapes:
    a, e = c.layer_prefix(i) + "linear_attn.", m.hidden_size
    hk, hv, dk, dv, _ = qwen3_next.linear_dims(m)
    return {a + "in_proj_qkv.weight": (2 * hk * dk + hv * dv, e), a + "in_proj_z.weight": (hv * dv, e),
            a + "in_proj_b.weight": (hv, e), a + "in_proj_a.weight": (hv, e)}


def dense_shapes(m) -> c.Shapes:
    return qwen3_next.dense_shapes(m, linear=linear_attention)

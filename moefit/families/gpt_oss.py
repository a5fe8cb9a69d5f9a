"""gpt-oss: GQA with biases and a learned attention sink per head, sliding (128) and full
attention alternating by `layer_types`; every layer MoE with a biased softmax router
(`mlp.router`) and experts with biases (kept with the dense weights) and a clamped SwiGLU
(alpha 1.702, limit 7).
Checkpoints store experts as MXFP4 blocks."""

from moefit.families import common as c
from moefit.families.state import AttentionKV

NAME = "gpt_oss"
RUNS = True


moe_layers = c.every_layer


def layer_types(m) -> list[str]:
    return m.raw.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                        for i in range(m.num_layers)]


def layer_states(m) -> list:
    window = m.raw.get("sliding_window") or 128
    return [AttentionKV(m.num_kv_heads, m.head_dim, m.head_dim, window if kind == "sliding_attention" else None)
            for kind in layer_types(m)]


def dense_shapes(m) -> c.Shapes:
    shapes = c.outer(m)
    for i in range(m.num_layers):
        a, r = c.layer_prefix(i) + "self_attn.", c.layer_prefix(i) + "mlp.router."
        shapes |= c.norms(i, m.hidden_size) | c.gqa(i, m, bias=True, o_bias=True)
        e = c.layer_prefix(i) + "mlp.experts."
        shapes |= {a + "sinks": (m.num_heads,), r + "weight": (m.num_experts, m.hidden_size),
                   r + "bias": (m.num_experts,), e + "gate_up_proj_bias": (m.num_experts, 2 * m.expert_size),
                   e + "down_proj_bias": (m.num_experts, m.hidden_size)}      # the experts' biases: dense
    return shapes

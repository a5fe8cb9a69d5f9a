"""GLM-4.5 / 4.6 / 4.7 (glm4_moe): GQA with q/k/v biases, partial rotary (half the head),
optional QK-norm; `first_k_dense_replace` dense layers, then MoE layers with a shared expert
and DeepSeek-V3's router (sigmoid scores, e_score_correction_bias for the choice only,
group-limited top-k, routed_scaling_factor)."""

from moefit.families import common as c

NAME = "glm4_moe"
RUNS = True


def moe_layers(cfg: dict, layers: int) -> tuple[int, ...]:
    return c.first_dense(cfg, layers)


layer_states = c.full_gqa


def shared_size(m) -> int:
    return (m.raw.get("n_shared_experts") or 0) * m.expert_size


def layer_shapes(i: int, m, moe: bool) -> c.Shapes:
    qk = (m.head_dim, m.head_dim) if m.raw.get("use_qk_norm") else None
    shapes = c.norms(i, m.hidden_size) | c.gqa(i, m, bias=bool(m.raw.get("attention_bias")), qk_norm=qk)
    if not moe:
        return shapes | c.dense_mlp(i, m)
    return (shapes | c.router(i, m, bias="e_score_correction_bias")
            | c.swiglu(c.layer_prefix(i) + "mlp.shared_experts.", m.hidden_size, shared_size(m)))


def dense_shapes(m) -> c.Shapes:
    shapes = c.outer(m)
    for i in range(m.num_layers):
        shapes |= layer_shapes(i, m, i in m.moe_layers)
    return shapes


# Multi-token prediction: DeepSeek-V3's (its names and layout), after the last layer.
MTP, mtp_layers, mtp_state = "nextn", c.mtp_count, c.first_layer_state


def mtp_shapes(m, j: int) -> c.Shapes:
    return c.nextn_layer(layer_shapes, m, j)

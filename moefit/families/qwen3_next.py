"""Qwen3-Next: three Gated DeltaNet (linear attention) layers to one full-attention layer
(full_attention_interval), the full ones with a gated query (q_proj twice as wide), QK-norm
and partial rotary; every layer MoE with a shared expert behind a sigmoid gate.

Gated DeltaNet keeps, per layer, a [value heads, key dim, value dim] state and the causal
conv's last (kernel - 1) inputs over q, k and v: constant in the context length."""

from moefit.families import common as c
from moefit.families.state import AttentionKV, RecurrentState

NAME = "qwen3_next"
RUNS = True


def moe_layers(cfg: dict, layers: int) -> tuple[int, ...]:
    return c.sparse_step(cfg, layers)


def layer_types(m) -> list[str]:
    every = m.raw.get("full_attention_interval") or 4
    return m.raw.get("layer_types") or ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                                        for i in range(m.num_layers)]


def linear_dims(m) -> tuple[int, int, int, int, int]:
    r = m.raw
    return (r["linear_num_key_heads"], r["linear_num_value_heads"], r["linear_key_head_dim"],
            r["linear_value_head_dim"], r["linear_conv_kernel_dim"])


def conv_channels(m) -> int:
    hk, hv, dk, dv, _ = linear_dims(m)
    return 2 * hk * dk + hv * dv


def layer_states(m) -> list:
    hk, hv, dk, dv, kernel = linear_dims(m)
    recurrent = RecurrentState(hv, dk, dv, conv_channels(m), kernel)
    full = AttentionKV(m.num_kv_heads, m.head_dim, m.head_dim)
    return [full if kind == "full_attention" else recurrent for kind in layer_types(m)]


def linear_attention(i: int, m) -> c.Shapes:
    """Qwen3-Next fuses q, k, v, z and b, a into two projections."""
    a, e = c.layer_prefix(i) + "linear_attn.", m.hidden_size
    hk, hv, dk, dv, _ = linear_dims(m)
    return {a + "in_proj_qkvz.weight": (2 * hk * dk + 2 * hv * dv, e), a + "in_proj_ba.weight": (2 * hv, e)}


def linear_common(i: int, m) -> c.Shapes:
    a = c.layer_prefix(i) + "linear_attn."
    hk, hv, dk, dv, kernel = linear_dims(m)
    return {a + "conv1d.weight": (conv_channels(m), 1, kernel), a + "dt_bias": (hv,), a + "A_log": (hv,),
            a + "norm.weight": (dv,), a + "out_proj.weight": (m.hidden_size, hv * dv)}


def moe(i: int, m) -> c.Shapes:
    p, e = c.layer_prefix(i) + "mlp.", m.hidden_size
    shared = m.raw.get("shared_expert_intermediate_size") or 0
    return c.router(i, m) | c.swiglu(p + "shared_expert.", e, shared) | {p + "shared_expert_gate.weight": (1, e)}


def full_attention(i: int, m) -> c.Shapes:
    """The gated full-attention layer: q_proj gives each head its query and its gate."""
    return c.gqa(i, m, q_out=2 * m.num_heads * m.head_dim, qk_norm=(m.head_dim, m.head_dim))


def dense_shapes(m, linear=linear_attention) -> c.Shapes:
    shapes = c.outer(m)
    for i, kind in enumerate(layer_types(m)):
        shapes |= c.norms(i, m.hidden_size)
        shapes |= full_attention(i, m) if kind == "full_attention" else linear(i, m) | linear_common(i, m)
        shapes |= moe(i, m) if i in m.moe_layers else c.dense_mlp(i, m)
    return shapes


# Multi-token prediction (mtp.* in the checkpoint): mtp.fc projects [RMSNorm(embedding of the next
# token); RMSNorm(hidden)] into mtp.layers.j, a full-attention MoE layer, then mtp.norm; the lm_head
# is the model's. A pack names mtp.layers.j model.layers.{L + j}, like DeepSeek's.
MTP = "qwen"


def mtp_layers(cfg: dict) -> int:
    """Qwen3-Next's config.json does not count its MTP layer; its published checkpoints carry one."""
    return c.mtp_count(cfg) or 1


def mtp_shapes(m, j: int) -> c.Shapes:
    i, e = m.num_layers + j, m.hidden_size
    extras = {"mtp.fc.weight": (e, 2 * e), "mtp.pre_fc_norm_embedding.weight": (e,),
              "mtp.pre_fc_norm_hidden.weight": (e,), "mtp.norm.weight": (e,)} if j == 0 else {}
    return c.norms(i, e) | full_attention(i, m) | moe(i, m) | extras


def mtp_state(m):
    return AttentionKV(m.num_kv_heads, m.head_dim, m.head_dim)

"""Weight-name pieces several families share (HF names, shapes [out, in]). No torch."""

from __future__ import annotations

import re

Shapes = dict[str, tuple[int, ...]]
LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")


def layer_prefix(i: int) -> str:
    return f"model.layers.{i}."


def outer(m) -> Shapes:
    """Embedding (host), final norm and lm_head (the embedding table when tied)."""
    e = m.hidden_size
    head = "model.embed_tokens.weight" if m.tie_word_embeddings else "lm_head.weight"
    return {"model.embed_tokens.weight": (m.vocab_size, e), "model.norm.weight": (e,), head: (m.vocab_size, e)}


def norms(i: int, e: int) -> Shapes:
    p = layer_prefix(i)
    return {p + "input_layernorm.weight": (e,), p + "post_attention_layernorm.weight": (e,)}


def gqa(i: int, m, q_out: int | None = None, bias: bool = False, o_bias: bool = False,
        qk_norm: tuple[int, int] | None = None) -> Shapes:
    """q/k/v/o projections of grouped-query attention; q_out widens q (Qwen3-Next's gate)."""
    a, e, hd = layer_prefix(i) + "self_attn.", m.hidden_size, m.head_dim
    q, kv = q_out or m.num_heads * hd, m.num_kv_heads * hd
    shapes = {a + "q_proj.weight": (q, e), a + "k_proj.weight": (kv, e), a + "v_proj.weight": (kv, e),
              a + "o_proj.weight": (e, m.num_heads * hd)}
    if bias:
        shapes.update({a + "q_proj.bias": (q,), a + "k_proj.bias": (kv,), a + "v_proj.bias": (kv,)})
    if o_bias:
        shapes[a + "o_proj.bias"] = (e,)
    if qk_norm:
        shapes.update({a + "q_norm.weight": (qk_norm[0],), a + "k_norm.weight": (qk_norm[1],)})
    return shapes


def swiglu(prefix: str, e: int, inner: int) -> Shapes:
    """gate_proj / up_proj / down_proj under `prefix` (a dense MLP or a shared expert)."""
    return {prefix + "gate_proj.weight": (inner, e), prefix + "up_proj.weight": (inner, e),
            prefix + "down_proj.weight": (e, inner)}


def dense_mlp(i: int, m) -> Shapes:
    return swiglu(layer_prefix(i) + "mlp.", m.hidden_size, m.dense_mlp_size)


def router(i: int, m, bias: str | None = None) -> Shapes:
    p = layer_prefix(i) + "mlp.gate."
    shapes = {p + "weight": (m.num_experts, m.hidden_size)}
    if bias:
        shapes[p + bias] = (m.num_experts,)
    return shapes


def every_layer(cfg: dict, layers: int) -> tuple[int, ...]:
    """Every layer is an MoE layer (Mixtral, OLMoE, gpt-oss)."""
    return tuple(range(layers))


def full_gqa(m) -> list:
    """Every layer full GQA attention with one KV row per token (the plain transformer's state)."""
    from moefit.families.state import AttentionKV
    return [AttentionKV(m.num_kv_heads, m.head_dim, m.head_dim) for _ in range(m.num_layers)]


def first_dense(cfg: dict, layers: int) -> tuple[int, ...]:
    """MoE layers after `first_k_dense_replace` dense ones (DeepSeek-V3, GLM-4.5)."""
    return tuple(range(cfg.get("first_k_dense_replace", 0) or 0, layers))


def sparse_step(cfg: dict, layers: int) -> tuple[int, ...]:
    """MoE layers by Qwen's decoder_sparse_step / mlp_only_layers."""
    step = cfg.get("decoder_sparse_step", 1) or 1
    dense = set(cfg.get("mlp_only_layers") or [])
    return tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)


def mtp_count(cfg: dict) -> int:
    """MTP layers a config declares: DeepSeek / GLM's num_nextn_predict_layers, Qwen3.5's
    mtp_num_hidden_layers (a pack counts the ones its checkpoint really has)."""
    return int(cfg.get("num_nextn_predict_layers") or cfg.get("mtp_num_hidden_layers") or 0)


def mtp_index(name: str, m) -> int | None:
    """Which MTP layer a weight belongs to (Qwen's mtp.* extras: the first), or None: a layer past
    the model's last is MTP layer (index - num_layers) (DeepSeek-V3's layer 61)."""
    if name.startswith("mtp."):
        return 0
    match = LAYER_INDEX.match(name)
    return int(match[1]) - m.num_layers if match is not None and int(match[1]) >= m.num_layers else None


def nextn(i: int, m) -> Shapes:
    """DeepSeek-V3's MTP extras around decoder layer i (GLM-4.5's too): the two input norms,
    the projection of [embedding; hidden] and the output norm (the head is the model's own)."""
    p, e = layer_prefix(i), m.hidden_size
    return {p + "enorm.weight": (e,), p + "hnorm.weight": (e,), p + "eh_proj.weight": (e, 2 * e),
            p + "shared_head.norm.weight": (e,)}


def nextn_layer(layer_shapes, m, j: int) -> Shapes:
    """MTP layer j in DeepSeek-V3's layout: the family's MoE decoder layer L + j and its extras."""
    i = m.num_layers + j
    return layer_shapes(i, m, moe=True) | nextn(i, m)


def first_layer_state(m):
    """An MTP layer's state: the family's first layer's (the same attention)."""
    return m.layer_states()[0]


def latent_attention(spec) -> bool:
    """Whether a family's attention is MLA (DeepSeek-V3, GLM-4.7-Flash): its declaration says LATENT."""
    return getattr(spec, "LATENT", False)


def rope_dim(m) -> int:
    """Channels RoPE rotates per head: MLA's rope key (all of it: transformers scales the rope head
    by partial_rotary_factor, which no MLA checkpoint sets below 1), else the partial or whole head."""
    return rotary_dim(m.raw, m.raw["qk_rope_head_dim"]) if latent_attention(m.spec) else rotary_dim(m.raw, m.head_dim)


def rotary_dim(cfg: dict, head_dim: int) -> int:
    """Rotated channels of a head: partial_rotary_factor (GLM, Qwen3-Next) or all."""
    factor = cfg.get("partial_rotary_factor")
    if factor is None:
        factor = (cfg.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0)
    return int(head_dim * factor)

"""DeepSeek-V3 (and Kimi-K2): multi-head latent attention (MLA). Keys and values are
rebuilt from a compressed latent c_kv [kv_lora_rank] plus one rope key [qk_rope_head_dim]
shared by all heads, and only those two are kept per token; queries go through a low-rank
q_a / q_b pair when q_lora_rank is set. First `first_k_dense_replace` layers dense, then
MoE with shared experts and a sigmoid, group-limited router (e_score_correction_bias,
routed_scaling_factor). FP8 block-quantised checkpoints are dequantised at pack time."""

from moefit.families import common as c
from moefit.families.state import LatentKV
from moefit.pack.layout import dense_quantizable

NAME = "deepseek_v3"
RUNS = True
LATENT = True           # MLA: a query / key head is nope + rope; RoPE turns the rope key alone


def moe_layers(cfg: dict, layers: int) -> tuple[int, ...]:
    return c.first_dense(cfg, layers)


def dims(m) -> tuple[int, int, int, int, int | None]:
    r = m.raw
    return r["kv_lora_rank"], r["qk_rope_head_dim"], r["qk_nope_head_dim"], r["v_head_dim"], r.get("q_lora_rank")


def layer_states(m) -> list:
    rank, rope, *_ = dims(m)
    return [LatentKV(rank, rope) for _ in range(m.num_layers)]


def attention(i: int, m) -> c.Shapes:
    a, e, h = c.layer_prefix(i) + "self_attn.", m.hidden_size, m.num_heads
    rank, rope, nope, v, q_rank = dims(m)
    shapes = {a + "kv_a_proj_with_mqa.weight": (rank + rope, e), a + "kv_a_layernorm.weight": (rank,),
              a + "kv_b_proj.weight": (h * (nope + v), rank), a + "o_proj.weight": (e, h * v)}
    if q_rank:
        shapes |= {a + "q_a_proj.weight": (q_rank, e), a + "q_a_layernorm.weight": (q_rank,),
                   a + "q_b_proj.weight": (h * (nope + rope), q_rank)}
    else:
        shapes[a + "q_proj.weight"] = (h * (nope + rope), e)
    return shapes


def layer_shapes(i: int, m, moe: bool) -> c.Shapes:
    shapes = c.norms(i, m.hidden_size) | attention(i, m)
    if not moe:
        return shapes | c.dense_mlp(i, m)
    shared = (m.raw.get("n_shared_experts") or 0) * m.expert_size
    return (shapes | c.router(i, m, bias="e_score_correction_bias")
            | c.swiglu(c.layer_prefix(i) + "mlp.shared_experts.", m.hidden_size, shared))


def per_head(m, dense_quant: str) -> bool:
    """Whether --dense-quant holds kv_b's per-head products quantised (models/deepseek_v3.py): each
    head's W_uk^T [r, dn] and W_uv [dv, r], stacked, where their inputs (dn, r) split into whole
    groups. A decode step then reads GLM-4.7-Flash's attention in 12.2 MB a layer at int4, against
    18.3 with the products absorbed into q_b and o_proj (round 20) and 28.0 with kv_b in fp32
    (memory/footprint.dense_bytes on configs/glm-4.7-flash.json)."""
    rank, _, nope, _, _ = dims(m)
    return dense_quant != "off" and all(dense_quantizable("w", (1, n), dense_quant) for n in (nope, rank))


KV_B_VALUES = ".values"         # the name W_uv's stack is charged under: kv_b_proj.weight.values


def quantised_shapes(m, shapes: c.Shapes, dense_quant: str) -> c.Shapes:
    """The attention's matrices as --dense-quant holds them (models/deepseek_v3.py): kv_b as its
    two stacks of per-head matrices, [H r, dn] and [H dv, r], quantised (per_head); elsewhere its
    per-head slices [H, dn + dv, r] in the compute dtype (not quantised)."""
    rank, _, nope, v, _ = dims(m)
    split, held = per_head(m, dense_quant), {}
    for name, shape in shapes.items():
        if not name.endswith("self_attn.kv_b_proj.weight"):
            held[name] = shape
        elif split:
            held[name], held[name + KV_B_VALUES] = (m.num_heads * rank, nope), (m.num_heads * v, rank)
        else:
            held[name] = (m.num_heads, nope + v, rank)
    return held


def dense_shapes(m) -> c.Shapes:
    shapes = c.outer(m)
    for i in range(m.num_layers):
        shapes |= layer_shapes(i, m, i in m.moe_layers)
    return shapes


# Multi-token prediction (DeepSeek-V3 section 2.2): layer L + j past the last is an MoE decoder
# layer fed RMSNorm(embedding of the next token) and RMSNorm(the hidden state) through eh_proj.
MTP, mtp_layers, mtp_state = "nextn", c.mtp_count, c.first_layer_state


def mtp_shapes(m, j: int) -> c.Shapes:
    return c.nextn_layer(layer_shapes, m, j)

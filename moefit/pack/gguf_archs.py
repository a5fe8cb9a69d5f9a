"""What each llama.cpp architecture in a GGUF file means to moefit: the family it is, the
HF config.json its metadata becomes, its tensor names, and the transforms llama.cpp's
converter applied that moefit undoes. One entry per architecture; gguf_source.py reads them.

    llama      Mixtral (converter permuted q/k rows for GGML's interleaved RoPE: undone)
    qwen3moe   Qwen3-MoE
    olmoe      OLMoE
    glm4moe    GLM-4.5 / 4.6 / 4.7 (block_count includes the MTP layers: not read)
    deepseek2  DeepSeek-V3 / Kimi-K2 (MLA's kv_b split into k_b (transposed) and v_b: joined back), and
               GLM-4.7-Flash (glm4_moe_lite: no gating key, sigmoid as llama.cpp takes it; MTP layers not read)
    gpt-oss    gpt-oss (the experts' gate and up biases, split by the converter, interleaved back as
               the HF checkpoint holds them; sliding attention on even layers, as llama.cpp has it)
    qwen35moe  Qwen3.5 / 3.6-MoE, and qwen3next (Qwen3-Next), both read into Qwen3.5's layout: the
               converter stored zero-centred norms as 1 + w, A_log as -exp(A_log), the conv squeezed,
               and (qwen35moe, when key heads < value heads) the value heads tiled instead of grouped;
               all undone. Qwen3-Next's fused projections were already split into Qwen3.5's q/k/v and z.

Every mapping is checked against llama.cpp's own converter and llama.cpp's logits
(bench/gguf_families.py) and, in CI, on files written the same way (tests/test_gguf.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from moefit.errors import PackError

Meta = Callable[[str, object], object]           # m(key without the "ARCH." prefix, default)

TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
       "output.weight": "lm_head.weight"}
ATTENTION = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
             "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
             "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
             "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
             "attn_v.bias": "self_attn.v_proj.bias",
             "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
ROUTER = {"ffn_gate_inp.weight": "mlp.gate.weight", "exp_probs_b.bias": "mlp.gate.e_score_correction_bias"}
DENSE_MLP = {"ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
             "ffn_down.weight": "mlp.down_proj.weight"}
SHARED = {"ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
          "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
          "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight"}
MLA = {"attn_q_a.weight": "self_attn.q_a_proj.weight", "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
       "attn_q_b.weight": "self_attn.q_b_proj.weight", "attn_q.weight": "self_attn.q_proj.weight",
       "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
       "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight", "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
       "attn_output.weight": "self_attn.o_proj.weight", "attn_norm.weight": "input_layernorm.weight",
       "ffn_norm.weight": "post_attention_layernorm.weight"}
GATING = {1: "softmax", 2: "sigmoid"}                     # llama.cpp's expert_gating_func


@dataclass(frozen=True)
class Arch:
    model_type: str
    architecture: str
    names: dict[str, str]                                  # per-layer GGUF name -> HF name (after model.layers.N.)
    config: Callable[[Meta], dict]                         # HF config keys of this family, from the metadata
    fix: Callable[[str, torch.Tensor, dict], torch.Tensor] | None = None     # undo a converter transform
    joins: dict[str, tuple[tuple[str, ...], Callable]] = field(default_factory=dict)  # HF <- several GGUF tensors
    splits: dict[str, tuple[tuple[str, ...], Callable]] = field(default_factory=dict)  # one GGUF tensor -> HF
    layers: Callable[[Meta], int] = lambda m: m("block_count", None)          # the model's own layers


def common_config(m: Meta) -> dict:
    heads = m("attention.head_count", None)
    hidden = m("embedding_length", None)
    return {"hidden_size": hidden, "num_attention_heads": heads,
            "num_key_value_heads": m("attention.head_count_kv", heads),
            "head_dim": m("attention.key_length", hidden // heads),
            "num_experts_per_tok": m("expert_used_count", None),
            "rms_norm_eps": m("attention.layer_norm_rms_epsilon", 1e-6),
            "rope_theta": m("rope.freq_base", 10000.0), "max_position_embeddings": m("context_length", 4096)}


def _qwen3moe(m: Meta) -> dict:
    return {"num_experts": m("expert_count", None), "moe_intermediate_size": m("expert_feed_forward_length", None),
            "intermediate_size": m("feed_forward_length", m("expert_feed_forward_length", None)),
            "norm_topk_prob": True}


def _mixtral(m: Meta) -> dict:
    if not m("expert_count", 0):
        raise PackError("a dense llama model: moefit runs mixture-of-experts models (Mixtral is llama with experts)")
    return {"num_local_experts": m("expert_count", None), "intermediate_size": m("feed_forward_length", None)}


def _olmoe(m: Meta) -> dict:
    return {"num_experts": m("expert_count", None), "intermediate_size": m("feed_forward_length", None),
            "norm_topk_prob": False, "clip_qkv": None}


def _routing(m: Meta, default_gating: str) -> dict:
    gating = GATING.get(m("expert_gating_func", None), default_gating)
    if gating != "sigmoid":
        raise PackError(f"expert gating {gating!r}: moefit runs the sigmoid routing of DeepSeek-V3 and GLM-4.5 "
                        "(DeepSeek-V2's softmax routing is not supported)")
    return {"n_routed_experts": m("expert_count", None), "moe_intermediate_size": m("expert_feed_forward_length", None),
            "intermediate_size": m("feed_forward_length", None), "n_shared_experts": m("expert_shared_count", 0),
            "first_k_dense_replace": m("leading_dense_block_count", 0),
            "routed_scaling_factor": m("expert_weights_scale", 1.0),
            "norm_topk_prob": bool(m("expert_weights_norm", False)),
            "n_group": m("expert_group_count", 1) or 1, "topk_group": m("expert_group_used_count", 1) or 1,
            "scoring_func": "sigmoid", "topk_method": "noaux_tc"}


def _glm4moe(m: Meta) -> dict:
    head_dim = m("attention.key_length", m("embedding_length", None) // m("attention.head_count", None))
    return {**_routing(m, "sigmoid"), "partial_rotary_factor": m("rope.dimension_count", head_dim) / head_dim}


def _own_layers(m: Meta) -> int:
    """block_count less the MTP layers after the model's own (GLM's converters write them)."""
    return m("block_count", None) - (m("nextn_predict_layers", 0) or 0)


def glm_flash(m: Meta) -> bool:
    """A GLM-4.7-Flash file: llama.cpp's converter writes it as deepseek2 without an expert gating
    key, and llama.cpp itself (src/models/deepseek2.cpp) takes 47 or 48 layers and a vocabulary of
    154880 for GLM-4.7-Flash, whose routing is sigmoid; GLM's own pre-tokenizer says so too."""
    return m("tokenizer.ggml.pre", None) == "glm4" or (
        _own_layers(m) in (47, 48) and len(m("tokenizer.ggml.tokens", ())) == 154880)


def _deepseek2(m: Meta) -> dict:
    rope, glm = m("rope.dimension_count", None), glm_flash(m)
    cfg = {**_routing(m, "sigmoid" if glm else "softmax"), "q_lora_rank": m("attention.q_lora_rank", None),
           "kv_lora_rank": m("attention.kv_lora_rank", None), "qk_rope_head_dim": rope,
           "qk_nope_head_dim": m("attention.key_length_mla", None) - rope,
           "v_head_dim": m("attention.value_length_mla", None), "rope_interleave": True,
           "head_dim": rope, "num_key_value_heads": m("attention.head_count", None)}
    if glm:                                 # the same forward (models/__init__.py); the family by its name
        cfg.update(model_type="glm4_moe_lite", architectures=["Glm4MoeLiteForCausalLM"])
    if m("rope.scaling.type", None) == "yarn":
        cfg["rope_scaling"] = {"type": "yarn", "factor": m("rope.scaling.factor", 1.0),
                               "original_max_position_embeddings": m("rope.scaling.original_context_length", None),
                               "mscale": 1.0, "mscale_all_dim": m("rope.scaling.yarn_log_multiplier", 0.0) / 0.1,
                               "beta_fast": m("rope.scaling.yarn_beta_fast", 32),
                               "beta_slow": m("rope.scaling.yarn_beta_slow", 1)}
    return cfg


def _gpt_oss(m: Meta) -> dict:
    layers = m("block_count", None)
    rope = {"rope_type": "default", "rope_theta": m("rope.freq_base", 150000.0)}
    if m("rope.scaling.type", None) == "yarn":
        rope.update(rope_type="yarn", factor=m("rope.scaling.factor", 1.0), truncate=False,
                    original_max_position_embeddings=m("rope.scaling.original_context_length", None),
                    beta_fast=m("rope.scaling.yarn_beta_fast", 32.0), beta_slow=m("rope.scaling.yarn_beta_slow", 1.0))
    return {"num_local_experts": m("expert_count", None),
            "intermediate_size": m("expert_feed_forward_length", m("feed_forward_length", None)),
            "sliding_window": m("attention.sliding_window", None),
            "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
            "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "rope_parameters": rope}    # llama.cpp's constants too


def interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gpt-oss's gate_up bias [N, 2I] with gate at even and up at odd columns, from the two halves."""
    return torch.stack((gate, up), dim=-1).flatten(-2)


HYBRID = {"attn_norm.weight": "input_layernorm.weight", "post_attention_norm.weight": "post_attention_layernorm.weight",
          "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
          "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
          "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
          "attn_qkv.weight": "linear_attn.in_proj_qkv.weight", "attn_gate.weight": "linear_attn.in_proj_z.weight",
          "ssm_beta.weight": "linear_attn.in_proj_b.weight", "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
          "ssm_conv1d.weight": "linear_attn.conv1d.weight", "ssm_a": "linear_attn.A_log",
          "ssm_dt.bias": "linear_attn.dt_bias", "ssm_norm.weight": "linear_attn.norm.weight",
          "ssm_out.weight": "linear_attn.out_proj.weight", "ffn_gate_inp.weight": "mlp.gate.weight",
          "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
          "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
          "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
          "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight"}


def _hybrid(m: Meta) -> dict:
    layers, head_dim = m("block_count", None), m("attention.key_length", None)
    recurrent = m("attention.recurrent_layers", None) or [(i + 1) % 4 != 0 for i in range(layers)]
    value_heads = m("ssm.time_step_rank", None)
    return {"layer_types": ["linear_attention" if r else "full_attention" for r in recurrent[:layers]],
            "linear_conv_kernel_dim": m("ssm.conv_kernel", None), "linear_key_head_dim": m("ssm.state_size", None),
            "linear_num_key_heads": m("ssm.group_count", None), "linear_num_value_heads": value_heads,
            "linear_value_head_dim": m("ssm.inner_size", None) // value_heads,
            "num_experts": m("expert_count", None), "moe_intermediate_size": m("expert_feed_forward_length", None),
            "shared_expert_intermediate_size": m("expert_shared_feed_forward_length", 0),
            "partial_rotary_factor": m("rope.dimension_count", head_dim) / head_dim, "norm_topk_prob": True,
            "full_attention_interval": m("full_attention_interval", 4)}


def hybrid_fix(tiled: bool) -> Callable[[str, torch.Tensor, dict], torch.Tensor]:
    """The converter's transforms of a Qwen3-Next / 3.5 tensor, undone (tiled: value heads were
    reordered from grouped by key head to tiled, qwen35moe's converter)."""
    def fix(name: str, t: torch.Tensor, cfg: dict) -> torch.Tensor:
        if name.endswith("norm.weight") and "linear_attn" not in name:
            return t - 1                                            # stored as 1 + w
        if name.endswith("A_log"):
            t = torch.log(-t)                                       # stored as -exp(A_log)
        if name.endswith("conv1d.weight"):
            t = t.unsqueeze(1)                                      # [C, 1, K], as nn.Conv1d holds it
        if name.endswith("shared_expert_gate.weight"):
            t = t.reshape(1, -1)        # [1, E]: llama.cpp's quantiser writes it 1-D (ggml drops a trailing 1)
        return _untile(name, t, cfg) if tiled else t
    return fix


def _untile(name: str, t: torch.Tensor, cfg: dict) -> torch.Tensor:
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    if hk == hv or "linear_attn" not in name:
        return t
    dk, dv, r = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], hv // hk
    group = lambda x, dim, d: _regroup(x, dim, hk, r, d)  # noqa: E731
    if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
        qk = 2 * hk * dk
        return torch.cat([t[:qk], group(t[qk:], 0, dv)])
    if name.endswith("in_proj_z.weight"):
        return group(t, 0, dv)
    if name.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
        return group(t, 0, 1)
    if name.endswith("out_proj.weight"):
        return group(t, 1, dv)
    return t


def _regroup(t: torch.Tensor, dim: int, hk: int, r: int, d: int) -> torch.Tensor:
    """Value heads from tiled order [K0 v0, K1 v0, ..., K0 v1, ...] back to grouped by key head."""
    shape = list(t.shape)
    tiled = t.reshape(*shape[:dim], r, hk, d, *shape[dim + 1:])
    return tiled.transpose(dim, dim + 1).reshape(shape)


def split_ba(ba: torch.Tensor, cfg: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-Next's in_proj_ba rows, [b (r), a (r)] per key head, as Qwen3.5's in_proj_b and in_proj_a."""
    hk, r = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"] // cfg["linear_num_key_heads"]
    b, a = ba.view(hk, 2 * r, -1).split([r, r], dim=1)
    return b.reshape(hk * r, -1), a.reshape(hk * r, -1)


def unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf's LlamaModel.permute: rows per head back from GGML's interleaved
    RoPE pairs to HF's two halves."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama_fix(name: str, t: torch.Tensor, cfg: dict) -> torch.Tensor:
    if name.endswith("self_attn.q_proj.weight"):
        return unpermute(t, cfg["num_attention_heads"])
    if name.endswith("self_attn.k_proj.weight"):
        return unpermute(t, cfg["num_key_value_heads"])
    return t


def join_kv_b(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """DeepSeek's kv_b_proj [H * (nope + v), rank] from llama.cpp's k_b [H, rank, nope] (transposed)
    and v_b [H, v, rank]."""
    rank = k_b.shape[1]
    return torch.cat((k_b.transpose(1, 2), v_b), dim=1).reshape(-1, rank)


ARCHS: dict[str, Arch] = {
    "qwen3moe": Arch("qwen3_moe", "Qwen3MoeForCausalLM", {**ATTENTION, **ROUTER, **DENSE_MLP}, _qwen3moe),
    "llama": Arch("mixtral", "MixtralForCausalLM", {**ATTENTION, **ROUTER}, _mixtral, fix=_llama_fix),
    "olmoe": Arch("olmoe", "OlmoeForCausalLM", {**ATTENTION, **ROUTER}, _olmoe),
    "glm4moe": Arch("glm4_moe", "Glm4MoeForCausalLM",
                    {**ATTENTION, **ROUTER, **DENSE_MLP, **SHARED,
                     "post_attention_norm.weight": "post_attention_layernorm.weight"}, _glm4moe,
                    layers=_own_layers),
    "deepseek2": Arch("deepseek_v3", "DeepseekV3ForCausalLM", {**MLA, **ROUTER, **DENSE_MLP, **SHARED}, _deepseek2,
                      joins={"self_attn.kv_b_proj.weight": (("attn_k_b.weight", "attn_v_b.weight"), join_kv_b)},
                      layers=_own_layers),
    "gpt-oss": Arch("gpt_oss", "GptOssForCausalLM",
                    {**ATTENTION, "attn_output.bias": "self_attn.o_proj.bias", "attn_sinks.weight": "self_attn.sinks",
                     "post_attention_norm.weight": "post_attention_layernorm.weight",
                     "ffn_gate_inp.weight": "mlp.router.weight", "ffn_gate_inp.bias": "mlp.router.bias",
                     "ffn_down_exps.bias": "mlp.experts.down_proj_bias"}, _gpt_oss,
                    joins={"mlp.experts.gate_up_proj_bias": (("ffn_gate_exps.bias", "ffn_up_exps.bias"), interleave)}),
    "qwen35moe": Arch("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", HYBRID, _hybrid, fix=hybrid_fix(tiled=True)),
    "qwen3next": Arch("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM",
                      HYBRID, _hybrid, fix=hybrid_fix(tiled=False),
                      splits={"ssm_ba.weight": (("linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight"),
                                                split_ba)}),
}

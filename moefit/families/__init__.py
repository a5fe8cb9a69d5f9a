"""What each model family is, declared without torch: its MoE layers, each layer's sequence
state (families/state.py) and its dense weights by HF name. `memory/footprint` and the
planner read these, so `moefit plan` works for a family before moefit runs it; the
forward passes live in `models/` (one file per family there too).

Usage: spec = family_spec("glm4_moe"); spec.layer_states(model_config)
"""

from __future__ import annotations

from types import ModuleType

from moefit.families import (deepseek_v3, glm4_moe, glm4_moe_lite, gpt_oss, mixtral, olmoe, qwen3_5_moe, qwen3_moe,
                             qwen3_next)

SPECS: dict[str, ModuleType] = {s.NAME: s for s in (qwen3_moe, mixtral, olmoe, qwen3_5_moe, qwen3_next, gpt_oss,
                                                      deepseek_v3, glm4_moe, glm4_moe_lite)}
ALIASES = {"qwen3_5_moe_text": "qwen3_5_moe", "qwen3_moe_text": "qwen3_moe"}
RUNNABLE = tuple(name for name, s in SPECS.items() if s.RUNS)


def family_name(model_type: str | None) -> str | None:
    return ALIASES.get(model_type, model_type)


def family_spec(family: str) -> ModuleType:
    return SPECS[family]


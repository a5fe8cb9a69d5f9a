"""Constrained decoding in the engine: the grammar holds inside speculative windows, and a
seed gives the same constrained text with and without speculation."""

import json

import pytest

from moefit.config import ServeConfig
from moefit.runtime.engine import Engine
from moefit.runtime.grammar import json_schema_grammar
from moefit.runtime.sampler import SamplingParams

pytest.importorskip("llguidance")
SCHEMA = {"type": "object", "properties": {"words": {"type": "array", "items": {"type": "string"}, "maxItems": 4}},
          "required": ["words"], "additionalProperties": False}


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_the_grammar_holds_inside_speculative_windows(packs, temperature):
    pack = packs("qwen3_moe", "int8")
    prompt = [5, 17, 42, 99, 7, 3] * 5
    params = SamplingParams(max_tokens=80, temperature=temperature, seed=3, grammar=json_schema_grammar(SCHEMA))
    plain = Engine.open(pack, ServeConfig(ctx=256)).generate(prompt, params)
    spec_engine = Engine.open(pack, ServeConfig(ctx=256, spec="lookup", spec_window=3))
    spec = spec_engine.generate(prompt, params)
    assert spec[1].generated == plain[1].generated and spec_engine.spec_stats.windows > 0
    assert spec[2] == "stop" and set(json.loads(spec[0])) == {"words"}

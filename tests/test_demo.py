"""The bundled demo model: transformers and moefit agree on it, and it writes the
corpus's English."""

import gzip
import re

import pytest
import torch

from moefit.config import ServeConfig
from moefit.demo import MODEL
from moefit.runtime.engine import Engine
from moefit.runtime.sampler import SamplingParams

pytestmark = pytest.mark.skipif(not (MODEL / "config.json").exists(), reason="the demo model is not in this checkout")
PROMPTS = ["Define: lantern\n", "Define: river\n", "Define: to wander\n"]


@pytest.fixture(scope="module")
def fp32_pack(tmp_path_factory):
    from moefit.pack.convert import convert
    out = tmp_path_factory.mktemp("demo") / "pack"
    convert(MODEL, out, "fp32", progress=False)
    return out


def test_transformers_and_moefit_agree_on_the_shipped_checkpoint(fp32_pack):
    from transformers import AutoModelForCausalLM
    ref = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    engine = Engine.open(fp32_pack, ServeConfig(ctx=256))
    for prompt in PROMPTS:
        ids = engine.codec.encode(prompt)
        want = ref.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(ids):].tolist()
        got = engine.generate(ids, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[1].generated
        assert got == want, prompt


def test_the_demo_writes_the_corpus_english():
    from moefit.demo import demo_pack
    vocab = set(gzip.open(MODEL / "corpus_words.txt.gz", "rt").read().split())
    engine = Engine.open(demo_pack(), ServeConfig(ctx=512))
    words = []
    for i, prompt in enumerate(["Define: lantern", "Define: harbor", "Define: bright"]):
        ids = engine.codec.encode(engine.codec.render_chat([{"role": "user", "content": prompt}]))
        text = engine.generate(ids, SamplingParams(max_tokens=60, temperature=0.7, seed=i))[0]
        words += re.findall(r"[a-z]+", text.lower())
    assert len(words) >= 30
    assert sum(w in vocab for w in words) / len(words) >= 0.8


def test_the_model_card_gives_its_figures():
    card = (MODEL / "MODEL_CARD.md").read_text()
    for needle in ("WordNet", "licence", "tokens seen", "perplexity", "unigram", "top quarter"):
        assert needle in card


def test_the_demo_template_renders_tools_and_keeps_the_trained_turns():
    from moefit.runtime.text import TextCodec
    codec = TextCodec.load(MODEL)
    plain = codec.render_chat([{"role": "user", "content": "Define: lantern"}])
    assert plain == "<|im_start|>user\nDefine: lantern<|im_end|>\n<|im_start|>assistant\n"
    tools = [{"type": "function", "function": {"name": "lookup_word", "parameters": {"type": "object"}}}]
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "lookup_word", "arguments": {"word": "lantern"}}}]}
    text = codec.render_chat([{"role": "user", "content": "Define: lantern"}, call,
                              {"role": "tool", "tool_call_id": "c1", "content": "a lamp"}], tools=tools)
    assert "<tools>" in text and '"name": "lookup_word"' in text and "<tool_call>" in text
    assert "<tool_response>\na lamp\n</tool_response>" in text

"""Chat template, tokenizer, incremental detokenisation, stop strings."""

import pytest
from transformers import PreTrainedTokenizerFast

from moefit.runtime.text import Detokenizer, StopMatcher, TextCodec

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
CONVERSATIONS = [
    [{"role": "user", "content": "Define: lantern"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo, 世界"},
     {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Again"}],
    [{"role": "user", "content": "Weather in Paris?"},
     {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "id": "c1", "function": {
         "name": "get_weather", "arguments": {"city": "Paris"}}}]},
     {"role": "tool", "content": "{\"temp\": 21}", "tool_call_id": "c1"}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_chat_template_matches_transformers_for_qwen3(qwen3_tokenizer_dir, messages, tools):
    ref = PreTrainedTokenizerFast.from_pretrained(qwen3_tokenizer_dir)
    codec = TextCodec.load(qwen3_tokenizer_dir)
    want = ref.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    got = codec.render_chat(messages, tools=tools)
    assert got == want
    assert codec.encode(got) == ref(want, add_special_tokens=False)["input_ids"]


def test_detokenizer_never_emits_half_a_character(qwen3_tokenizer_dir):
    codec = TextCodec.load(qwen3_tokenizer_dir)
    text = "lantern 🏮 und Ölfunzel, 灯笼!"
    detok = Detokenizer(codec)
    deltas = [detok.push(t) for t in codec.encode(text)]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_stop_strings_are_held_back_and_cut():
    m = StopMatcher(("\nUser:",))
    out = [m.feed(piece) for piece in ["Hello", " there", "\nUs", "er: more"]]
    assert "".join(text for text, _ in out) == "Hello there" and out[-1][1]
    m = StopMatcher(("END",))
    assert m.feed("abcEN") == ("abc", False) and m.feed("x") == ("E", False) and m.flush() == "Nx"

"""Tool calls in both spellings a chat template teaches (serve/toolparse.py), whole and streamed a
character at a time, and GLM's forced call (runtime/grammar.py) on a model with GLM's tokenizer."""

import json
from pathlib import Path

import pytest

from moefit.serve.toolparse import OutputParser, split_final

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "zip": {"type": "string"}, "days": {"type": "integer"},
    "units": {"type": "object"}}, "required": ["city"]}}}]
GLM = ("<think>the user wants weather</think>Let me look.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
       "<arg_value>Paris, FR</arg_value>\n<arg_key>zip</arg_key>\n<arg_value>75001</arg_value>\n"
       "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>units</arg_key>\n"
       '<arg_value>{"temp": "C"}</arg_value>\n</tool_call>')
QWEN = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris, FR", "days": 3}}\n</tool_call>'


def streamed(text: str, tools=TOOLS) -> list:
    parser = OutputParser(tools)
    items = [item for ch in text for item in parser.feed(ch)] + parser.finish()
    return [v for k, v in items if k == "tool_call"]


def test_a_glm_call_is_parsed_with_its_values_typed_by_the_schema():
    content, reasoning, calls = split_final(GLM, TOOLS)
    assert (content, reasoning) == ("Let me look.", "the user wants weather")
    assert calls[0]["function"]["name"] == "get_weather"
    args = json.loads(calls[0]["function"]["arguments"])
    assert args == {"city": "Paris, FR", "zip": "75001", "days": 3, "units": {"temp": "C"}}   # "75001" a string
    assert [json.loads(c["function"]["arguments"]) for c in streamed(GLM)] == [args]
    assert json.loads(split_final(GLM)[2][0]["function"]["arguments"])["zip"] == 75001      # no schema: JSON


def test_glm_calls_without_newlines_or_arguments_and_two_in_a_row():
    text = ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value></tool_call>"
            "<tool_call>now\n</tool_call>")
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in streamed(text)]
    assert calls == [("get_weather", {"city": "Oslo"}), ("now", {})]


def test_qwen_calls_parse_as_before():
    assert [json.loads(c["function"]["arguments"]) for c in streamed(QWEN)] == [{"city": "Paris, FR", "days": 3}]


@pytest.mark.parametrize("body", ["get weather\n<arg_key>a</arg_key><arg_value>1</arg_value>",
                                  "get_weather\nstray text<arg_key>a</arg_key><arg_value>1</arg_value>",
                                  "get_weather<arg_key>a</arg_key><arg_value>1</arg_value> trailing", "", "{oops"])
def test_a_body_that_is_neither_spelling_stays_content_and_loses_nothing(body):
    text = f"<tool_call>{body}</tool_call>"
    content, _, calls = split_final(text, TOOLS)
    assert calls == [] and content == text


@pytest.fixture(scope="module")
def glm_server(tmp_path_factory):
    """A tiny GLM-4.5 model with GLM's own tokenizer and chat template, served."""
    import openai
    import tiny
    from moefit.memory.simcard import write_card
    from moefit.pack.convert import convert
    from serving import Served
    pytest.importorskip("llguidance")
    root = tmp_path_factory.mktemp("glm")
    hf = tiny.build_checkpoint("glm4_moe", root / "hf", tokenizer_dir=tiny.real_tokenizer("glm-4.5v", root / "tok"))
    convert(hf, root / "pack", "int8", progress=False)
    write_card(root / "card.json", "Test card (simulated)", 256, [])
    s = Served(root / "pack", root / "card.json", root / "state")
    s.openai = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
    s.pack = root / "pack"
    yield s
    s.stop()


def test_a_forced_call_on_a_glm_template_is_glm_s_spelling_and_valid_for_its_schema(glm_server):
    """tool_choice on a model whose template teaches <arg_key> pairs: the grammar makes the output
    that call (not Qwen's JSON, which the model was never taught), its arguments valid. (Enums and
    booleans only: a random model ends a free string or a number only by chance.)"""
    import jsonschema
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
                 "zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}},
             {"type": "function", "function": {"name": "set_mode", "parameters": {"type": "object", "properties": {
                 "mode": {"type": "string", "enum": ["eco", "fast"]}, "loud": {"type": "boolean"}},
                 "required": ["mode", "loud"]}}}]
    hi = [{"role": "user", "content": "What time is it?"}]
    for seed, choice in enumerate(("required", {"type": "function", "function": {"name": "get_time"}})):
        r = glm_server.openai.chat.completions.create(model="tiny", messages=hi, tools=tools, tool_choice=choice,
                                                      max_tokens=80, seed=seed)
        call = r.choices[0].message.tool_calls[0].function
        schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == call.name)
        assert r.choices[0].finish_reason == "tool_calls"
        jsonschema.validate(json.loads(call.arguments), schema)
    from moefit.pack.reader import Pack
    from moefit.runtime.text import TextCodec
    from moefit.serve import constrain
    from moefit.serve.protocol import ChatRequest
    codec = TextCodec.load(Pack.open(glm_server.pack).tokenizer_dir)
    grammar = constrain.chat_grammar(ChatRequest(model="tiny", messages=hi, tools=tools, tool_choice="required"), codec)
    assert codec.tool_call_style == "glm" and f"<[{codec.token_id('<arg_key>')}]>" in grammar


def test_the_glm_templates_teach_their_own_spacing(tmp_path):
    """GLM-4.5's template writes a call a line a key and value, GLM-4.7-Flash's all on one line."""
    import tiny
    from moefit.runtime.text import TextCodec
    styles = [TextCodec.load(tiny.real_tokenizer(name, tmp_path / name)).tool_call_style
              for name in ("glm-4.5v", "glm-4.7-flash", "qwen-3")]
    assert styles == ["glm", "glm-compact", "json"]


def test_the_template_says_which_spelling_a_forced_call_takes():
    pytest.importorskip("llguidance")
    from moefit.runtime.grammar import glm_tool_call_grammar
    from moefit.runtime.text import _tool_call_style
    assert _tool_call_style(None) == _tool_call_style("<tool_call>{{ tc | tojson }}</tool_call>") == "json"
    assert _tool_call_style("<arg_key>{{ k }}</arg_key>\n<arg_value>{{ v }}</arg_value>\n{% endfor %}") == "glm"
    assert _tool_call_style("<arg_key>{{ k }}</arg_key><arg_value>{{ v }}</arg_value>{% endfor %}") == "glm-compact"
    tags = {t: f'"{t}"' for t in ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
                                  "</arg_value>")}
    assert '"\\n"' in glm_tool_call_grammar(TOOLS, tags) and '"\\n"' not in glm_tool_call_grammar(TOOLS, tags, False)


def test_a_glm_string_argument_keeps_its_pattern_and_length():
    """GLM writes a string argument as it is, so its grammar is a regex, not %json: the schema's
    pattern (found anywhere unless anchored) and minLength / maxLength hold in it too."""
    llguidance = pytest.importorskip("llguidance")
    from tokenizers import Tokenizer
    from moefit.runtime.grammar import glm_tool_call_grammar
    tok = llguidance.LLTokenizer(Tokenizer.from_file(
        str(Path(__file__).resolve().parent.parent / "moefit" / "demo" / "model" / "tokenizer.json")).to_str())
    tags = {t: f'"{t}"' for t in ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
                                  "</arg_value>")}
    props = {"code": {"type": "string", "pattern": r"^[A-Z]{2}\d{3}$"}, "note": {"type": "string", "pattern": "ok"},
             "tag": {"type": "string", "minLength": 2, "maxLength": 3}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": props, "required": list(props)}}}]
    grammar = glm_tool_call_grammar(tools, tags, lines=False)

    def accepts(code: str, note: str, tag: str) -> bool:
        text = (f"<tool_call>f<arg_key>code</arg_key><arg_value>{code}</arg_value><arg_key>note</arg_key>"
                f"<arg_value>{note}</arg_value><arg_key>tag</arg_key><arg_value>{tag}</arg_value></tool_call>")
        m = llguidance.LLMatcher(tok, grammar)
        return bool(m.consume_tokens(tok.tokenize_str(text))) and not m.is_error() and m.is_accepting()
    assert accepts("AB123", "it is ok now", "xy")
    assert not accepts("AB1234", "it is ok now", "xy")          # anchored at both ends
    assert not accepts("ab123", "it is ok now", "xy")
    assert not accepts("AB123", "fine", "xy")                     # found nowhere
    assert not accepts("AB123", "ok", "x") and not accepts("AB123", "ok", "wxyz")

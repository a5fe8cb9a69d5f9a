"""Clients that speak OpenAI's Responses API or Anthropic's Messages, driven by their
official SDKs against a real `moefit serve`; context discovery as agent clients probe it;
errors in each protocol's own shape; one access-log line per request."""

import json

import anthropic
import httpx
import openai
import pytest

from moefit.memory.simcard import write_card

from serving import Served
from toolmodel import ASK, TOOLS

CARD = dict(name="RTX 4070 (simulated)", total_mib=120.0)
A_TOOLS = [{"name": "get_weather", "description": "Weather for a city",
            "input_schema": TOOLS[0]["function"]["parameters"]}]
GREEDY = {"temperature": 0}                    # anthropic's SDK 2.x takes no temperature argument
R_TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather for a city",
            "parameters": TOOLS[0]["function"]["parameters"]}]


@pytest.fixture(scope="module")
def server(tool_pack, tmp_path_factory):
    root = tmp_path_factory.mktemp("clients")
    card = root / "card.json"
    write_card(card, CARD["name"], CARD["total_mib"], [(2101, "gnome-shell", 10.0)])
    s = Served(tool_pack, card, root / "state", "--ctx", "2048")
    s.openai = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
    s.anthropic = anthropic.Anthropic(base_url=s.url, api_key="none", max_retries=0)
    yield s
    s.log = s.stop()


def test_anthropic_messages_with_thinking_and_tool_use(server):
    r = server.anthropic.messages.create(model="tiny", max_tokens=60, messages=ASK, tools=A_TOOLS, extra_body=GREEDY)
    kinds = [b.type for b in r.content]
    assert r.stop_reason == "tool_use" and kinds[0] == "thinking" and kinds[-1] == "tool_use"
    use = r.content[-1]
    assert use.name == "get_weather" and use.input == {"city": "Paris"} and use.id.startswith("toolu_")
    assert r.content[0].thinking == "The user wants the weather." and r.usage.output_tokens > 0


def test_anthropic_streaming_events_rebuild_the_same_message(server):
    with server.anthropic.messages.stream(model="tiny", max_tokens=60, messages=ASK, tools=A_TOOLS,
                                          extra_body=GREEDY) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start" and "content_block_delta" in events
    assert final.stop_reason == "tool_use" and final.content[-1].input == {"city": "Paris"}


def test_a_tool_result_goes_back_to_the_model_and_tokens_are_counted(server):
    first = server.anthropic.messages.create(model="tiny", max_tokens=60, messages=ASK, tools=A_TOOLS, extra_body=GREEDY)
    use = first.content[-1]
    follow = ASK + [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21 C"}]}]
    r = server.anthropic.messages.create(model="tiny", max_tokens=3, messages=follow, tools=A_TOOLS, system="Be brief.")
    assert r.usage.input_tokens > first.usage.input_tokens
    counted = server.anthropic.messages.count_tokens(model="tiny", messages=follow, tools=A_TOOLS, system="Be brief.")
    assert counted.input_tokens == r.usage.input_tokens


def test_anthropic_errors_come_in_anthropic_shape_and_x_api_key_is_read(server):
    with pytest.raises(anthropic.BadRequestError) as e:
        server.anthropic.messages.create(model="tiny", max_tokens=5, messages=[
            {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                       "data": "AA=="}}]}])
    assert e.value.body["type"] == "error" and "text only" in e.value.body["error"]["message"]


def test_the_responses_api_with_function_calls(server):
    r = server.openai.responses.create(model="tiny", input=ASK[0]["content"], tools=R_TOOLS, temperature=0,
                                       max_output_tokens=60)
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and calls and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {"city": "Paris"}
    follow = [{"role": "user", "content": ASK[0]["content"]}, calls[0].model_dump(),
              {"type": "function_call_output", "call_id": calls[0].call_id, "output": "21 C"}]
    again = server.openai.responses.create(model="tiny", input=follow, tools=R_TOOLS, max_output_tokens=3,
                                           instructions="Be brief.")
    assert again.usage.input_tokens > r.usage.input_tokens and again.status in ("completed", "incomplete")


def test_the_responses_stream_ends_with_the_completed_response(server):
    events = list(server.openai.responses.create(model="tiny", input="Hello", max_output_tokens=8, stream=True,
                                                 temperature=0))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].response.output_text == text
    assert [e.sequence_number for e in events] == list(range(1, len(events) + 1))


def test_context_discovery_as_agent_clients_probe_it(server):
    assert server.openai.models.retrieve("tiny").model_extra["max_model_len"] == 2048
    assert httpx.get(server.url + "/props").json()["n_ctx"] == 2048
    assert httpx.get(server.url + "/version").json()["name"] == "moefit"
    with pytest.raises(openai.BadRequestError) as e:
        server.openai.chat.completions.create(model="tiny", messages=ASK, max_tokens=65536)
    assert e.value.message.startswith("Error code: 400 - ") and \
        "This model's maximum context length is 2048 tokens. However, you requested" in str(e.value.body)


def test_unknown_routes_and_methods_answer_in_openai_shape(server):
    missing = httpx.get(server.url + "/v1/nothing")
    assert missing.status_code == 404 and "no route /v1/nothing" in missing.json()["error"]["message"]
    wrong = httpx.get(server.url + "/v1/chat/completions")
    assert wrong.status_code == 405 and wrong.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError) as e:
        server.openai.models.retrieve("gpt-9")
    assert "does not exist" in e.value.message


def test_every_status_is_counted_and_logged(server):
    httpx.get(server.url + "/v1/nothing")
    server.openai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    text = httpx.get(server.url + "/metrics").text
    assert 'moefit_http_requests_total{route="/v1/nothing",status="404"}' in text
    assert 'moefit_http_requests_total{route="/v1/chat/completions",status="200"}' in text


def test_the_access_log_has_a_line_per_request(tool_pack, tmp_path):
    card = tmp_path / "card.json"
    write_card(card, CARD["name"], CARD["total_mib"], [])
    s = Served(tool_pack, card, tmp_path / "state")
    httpx.post(s.url + "/v1/completions", json={"prompt": "a", "max_tokens": 2, "ignore_eos": True})
    with httpx.stream("POST", s.url + "/v1/completions", json={"prompt": "a", "max_tokens": 3, "ignore_eos": True,
                                                               "stream": True}) as r:
        list(r.iter_lines())
    log = s.stop()
    assert "moefit: POST /v1/completions 200 prompt=1 completion=2" in log
    assert "moefit: POST /v1/completions 200 prompt=1 completion=3" in log          # the stream, at its end


def test_chat_logprobs_are_the_models_own(server):
    r = server.openai.chat.completions.create(model="tiny", messages=ASK, max_tokens=6, temperature=0, logprobs=True,
                                              top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)   # greedy: the best one
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob
    stream = server.openai.chat.completions.create(model="tiny", messages=ASK, max_tokens=6, temperature=0,
                                                   logprobs=True, stream=True, extra_body={"ignore_eos": True})
    streamed = [e.logprob for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert streamed == pytest.approx([e.logprob for e in content], abs=1e-5)


def test_completion_logprobs_in_the_legacy_shape(server):
    r = server.openai.completions.create(model="tiny", prompt="The lantern", max_tokens=4, temperature=0, logprobs=2,
                                         extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == r.choices[0].text and lp.text_offset[0] == 0
    assert all(len(t) <= 2 for t in lp.top_logprobs) and all(v <= 0 for v in lp.token_logprobs)


def test_several_prompts_give_one_choice_each(server):
    r = server.openai.completions.create(model="tiny", prompt=["The lantern", "A river"], max_tokens=3, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == 6
    one = server.openai.completions.create(model="tiny", prompt="A river", max_tokens=3, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert r.choices[1].text == one.choices[0].text
    tokens = server.openai.completions.create(model="tiny", prompt=[[1, 2], [3]], max_tokens=1)
    assert len(tokens.choices) == 2 and tokens.usage.prompt_tokens == 3
    streamed = server.openai.completions.create(model="tiny", prompt=["The lantern", "A river"], max_tokens=3,
                                                temperature=0, stream=True, extra_body={"ignore_eos": True})
    texts = {}
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {0: r.choices[0].text, 1: r.choices[1].text}
    with pytest.raises(openai.BadRequestError):
        server.openai.completions.create(model="tiny", prompt=[], max_tokens=2)


HI = [{"role": "user", "content": "Hi"}]
SAMPLED = {"model": "tiny", "temperature": 2.0, "seed": 11, "max_tokens": 8, "extra_body": {"ignore_eos": True}}


def _said(message) -> tuple:
    return message.content, (message.model_extra or {}).get("reasoning_content")


def _prefix_hits(server) -> float:
    metrics = httpx.get(server.url + "/metrics").text.splitlines()
    return float(next(line for line in metrics if line.startswith("vllm:prefix_cache_hits_total")).split()[-1])


def test_n_choices_draw_seeds_of_their_own_and_the_first_is_n1s(server):
    one = server.openai.chat.completions.create(messages=HI, **SAMPLED)
    hits = _prefix_hits(server)
    r = server.openai.chat.completions.create(messages=HI, n=3, **SAMPLED)
    said = [_said(c.message) for c in r.choices]
    assert [c.index for c in r.choices] == [0, 1, 2] and len({c.message.role for c in r.choices}) == 1
    assert said[0] == _said(one.choices[0].message) and len(set(said)) == 3
    assert r.usage.prompt_tokens == one.usage.prompt_tokens and r.usage.completion_tokens == 24
    assert _prefix_hits(server) - hits >= 2 * (one.usage.prompt_tokens - 1)    # choices 1, 2 reuse the prompt
    again = server.openai.chat.completions.create(messages=HI, n=3, **SAMPLED)
    assert [_said(c.message) for c in again.choices] == said


def test_n_choices_stream_one_after_another_by_index(server):
    whole = server.openai.chat.completions.create(messages=HI, n=2, **SAMPLED)
    stream = server.openai.chat.completions.create(messages=HI, n=2, stream=True,
                                                   stream_options={"include_usage": True}, **SAMPLED)
    content, reasoning, finish, usage, ids = {0: "", 1: ""}, {0: "", 1: ""}, {}, None, set()
    for chunk in stream:
        usage, _ = chunk.usage or usage, ids.add(chunk.id)
        for c in chunk.choices:
            content[c.index] += c.delta.content or ""
            reasoning[c.index] += (c.delta.model_extra or {}).get("reasoning_content") or ""
            finish[c.index] = c.finish_reason or finish.get(c.index)
    assert [(content[i] or None, reasoning[i] or None) for i in (0, 1)] == [_said(c.message) for c in whole.choices]
    assert finish == {0: "length", 1: "length"} and usage.completion_tokens == 16 and len(ids) == 1


def test_completions_give_each_prompt_its_n_choices_in_turn(server):
    r = server.openai.completions.create(prompt=["The lantern", "A river"], n=2, **SAMPLED)
    river = server.openai.completions.create(prompt="A river", **SAMPLED)
    lantern = server.openai.completions.create(prompt="The lantern", **SAMPLED)
    assert [c.index for c in r.choices] == [0, 1, 2, 3] and r.choices[2].text == river.choices[0].text
    assert r.usage.prompt_tokens == river.usage.prompt_tokens + lantern.usage.prompt_tokens
    assert r.usage.completion_tokens == 32 and r.choices[0].text == lantern.choices[0].text
    with pytest.raises(openai.BadRequestError, match="less than or equal to 16"):
        server.openai.completions.create(prompt="a", n=17, max_tokens=1, model="tiny")


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.mark.parametrize("spec", [False, True])
def test_a_json_schema_is_enforced_on_a_random_model(server, spec):
    """The tiny model was never trained to write JSON: only the grammar can make this valid."""
    import jsonschema
    for seed in range(3):
        r = server.openai.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Who?"}], max_tokens=60, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                    "strict": True}})
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    obj = server.openai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                                max_tokens=200, response_format={"type": "json_object"}, seed=4)
    assert obj.choices[0].finish_reason == "stop" and isinstance(json.loads(obj.choices[0].message.content), dict)


def test_a_forced_tool_call_has_arguments_valid_for_its_schema(server):
    import jsonschema
    tools = TOOLS + [{"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}}]
    hi = [{"role": "user", "content": "Hi"}]
    r = server.openai.chat.completions.create(model="tiny", messages=hi, tools=tools, max_tokens=60, seed=1,
                                              tool_choice={"type": "function", "function": {"name": "get_time"}})
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), tools[1]["function"]["parameters"])
    r = server.openai.chat.completions.create(model="tiny", messages=hi, tools=tools, max_tokens=60, seed=2,
                                              tool_choice="required")
    assert r.choices[0].message.tool_calls and r.choices[0].finish_reason == "tool_calls"
    a = server.anthropic.messages.create(model="tiny", max_tokens=60, messages=hi, tool_choice={"type": "any"},
                                         tools=A_TOOLS, extra_body=GREEDY)
    assert a.stop_reason == "tool_use" and isinstance(a.content[-1].input.get("city"), str)
    with pytest.raises(openai.BadRequestError):
        server.openai.chat.completions.create(model="tiny", messages=hi, tools=tools, max_tokens=5,
                                              tool_choice={"type": "function", "function": {"name": "nope"}})


def test_a_logit_bias_forces_a_token_and_a_bad_one_is_a_400(server, qwen3_tokenizer_dir):
    from transformers import PreTrainedTokenizerFast
    tok = PreTrainedTokenizerFast.from_pretrained(qwen3_tokenizer_dir)
    [token] = tok.encode(" lantern")
    for n in (1, 2):
        r = server.openai.completions.create(model="tiny", prompt="A river", max_tokens=4, temperature=1.0, n=n,
                                             logit_bias={str(token): 100}, extra_body={"ignore_eos": True})
        assert [c.text for c in r.choices] == [" lantern" * 4] * n
    chat = server.openai.chat.completions.create(model="tiny", messages=HI, max_tokens=3, temperature=0,
                                                 logit_bias={str(token): 100}, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == " lantern" * 3
    for bias in ({"lantern": 5}, {"999999999": 5}, {str(token): 101}):
        with pytest.raises(openai.BadRequestError) as e:
            server.openai.completions.create(model="tiny", prompt="a", max_tokens=1, logit_bias=bias)
        assert e.value.body["param"] == "logit_bias"

"""Request parsing: whatever a client sends is a validated request or a 400 that names the
field; nothing a body holds reaches the engine as a crash."""

import json

import pytest

from moefit.serve import protocol as P

OK = {"messages": [{"role": "user", "content": "hi"}]}


def bad(body) -> P.ApiError:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(P.ApiError) as e:
        P.parse(P.ChatRequest, raw)
    assert e.value.status == 400 and e.value.message
    return e.value


def test_a_seed_past_64_bits_is_a_400_and_the_largest_one_is_accepted():
    assert bad({**OK, "seed": 2**64}).param == "seed"
    assert bad({**OK, "seed": -(2**63) - 1}).param == "seed"
    assert P.parse(P.ChatRequest, json.dumps({**OK, "seed": 2**64 - 1}).encode()).seed == 2**64 - 1


def test_a_lone_surrogate_is_a_400_naming_the_field():
    err = bad(b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}')
    assert err.param == "messages.0.content" and "surrogate" in err.message
    paired = P.parse(P.ChatRequest, b'{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}')
    assert paired.messages[0].content == "\U0001F600"


def test_a_body_nested_100000_deep_is_a_400():
    assert "nested deeper" in bad(b'{"messages": ' + b"[" * 100000 + b"]" * 100000 + b"}").message
    deep = {**OK, "tools": json.loads("[" * (P.MAX_DEPTH + 1) + "]" * (P.MAX_DEPTH + 1))}
    assert "nested deeper" in bad(deep).message
    fine = {**OK, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}
    assert P.parse(P.ChatRequest, json.dumps(fine).encode()).tools


@pytest.mark.parametrize("text", [b"NaN", b"Infinity", b"-Infinity"])
def test_nan_and_infinity_are_not_json(text):
    err = bad(b'{"messages": [{"role": "user", "content": "x"}], "temperature": ' + text + b"}")
    assert "not valid JSON" in err.message and text.decode().lstrip("-") in err.message


def test_an_image_part_is_a_400_naming_the_part_not_dropped():
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                                      {"type": "image_url", "image_url": {"url": "data:,"}}]}]}
    err = bad(body)
    assert err.param == "messages.0.content.1" and "image_url" in err.message and "text only" in err.message
    text_only = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}
    assert P.message_dicts(P.parse(P.ChatRequest, json.dumps(text_only).encode()).messages)[0]["content"] == "ab"


@pytest.mark.parametrize("kind,body,field", [
    (P.ChatRequest, {**OK, "functions": [{"name": "f", "parameters": {}}]}, "functions"),
    (P.ChatRequest, {**OK, "function_call": {"name": "f"}}, "function_call"),
    (P.CompletionRequest, {"prompt": "def f(", "suffix": "\n    return x"}, "suffix"),
    (P.CompletionRequest, {"prompt": "a", "best_of": 3}, "best_of"),
    (P.CompletionRequest, {"prompt": "a", "n": 2, "best_of": 4}, "best_of"),
])
def test_a_field_that_would_change_the_answer_is_a_400_not_ignored(kind, body, field):
    with pytest.raises(P.ApiError) as e:
        P.parse(kind, json.dumps(body).encode())
    assert e.value.status == 400 and e.value.param == field
    del body[field]
    P.parse(kind, json.dumps(body).encode())
    assert P.parse(P.CompletionRequest, json.dumps({"prompt": "a", "n": 2, "best_of": 2}).encode()).n == 2

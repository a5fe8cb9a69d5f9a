"""A real `moefit serve` on a tiny model with the real Qwen3 tokenizer, driven by the
official openai client. The model is overfit to answer one tool-using conversation with
a <think> block and a <tool_call>, so parsing is tested on text a model really emits."""

import json
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from moefit.memory.simcard import write_card

from serving import Served
from toolmodel import ASK, TOOLS

CARD = dict(name="RTX 4070 (simulated)", total_mib=120.0)
DESKTOP = [(2101, "gnome-shell", 10.0)]


@pytest.fixture(scope="module")
def model_pack(tool_pack):
    return tool_pack


@pytest.fixture(scope="module")
def server(model_pack, tmp_path_factory):
    root = tmp_path_factory.mktemp("server")
    card = root / "card.json"
    write_card(card, CARD["name"], CARD["total_mib"], DESKTOP)
    s = Served(model_pack, card, root / "state", "--max-queue", "1", "--sessions", "2")
    s.card = card
    s.client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
    yield s
    s.stop()


def test_chat_completion_with_usage(server):
    r = server.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=5, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens <= 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streaming_with_usage(server):
    stream = server.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                   max_tokens=6, temperature=0, stream=True,
                                                   stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 6 and chunks[-1].choices == []


def test_completions_and_models(server):
    r = server.client.completions.create(model="tiny", prompt="The lantern", max_tokens=4, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.usage.completion_tokens == 4
    r2 = server.client.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=2, extra_body={"ignore_eos": True})
    assert r2.usage.prompt_tokens == 3
    assert [m.id for m in server.client.models.list().data] == ["tiny"]


def test_the_tool_schema_is_rendered_into_the_prompt(server, qwen3_tokenizer_dir):
    from transformers import PreTrainedTokenizerFast
    tok = PreTrainedTokenizerFast.from_pretrained(qwen3_tokenizer_dir)
    want = len(tok.apply_chat_template(ASK, tools=TOOLS, add_generation_prompt=True, tokenize=True)["input_ids"])
    r = server.client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=1)
    assert r.usage.prompt_tokens == want
    r = server.client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=1)
    assert r.usage.prompt_tokens < want


def test_the_chat_templates_variables_reach_it(server, qwen3_tokenizer_dir):
    """vLLM's chat_template_kwargs (Qwen3's enable_thinking), the Responses API's reasoning effort
    and Anthropic's thinking switch render the prompt as transformers renders it."""
    from transformers import PreTrainedTokenizerFast
    tok = PreTrainedTokenizerFast.from_pretrained(qwen3_tokenizer_dir)
    hi = [{"role": "user", "content": "Hi"}]
    want = lambda **kw: len(tok.apply_chat_template(  # noqa: E731
        hi, add_generation_prompt=True, tokenize=True, **kw)["input_ids"])
    ask = lambda **kw: server.client.chat.completions.create(model="tiny", messages=hi, max_tokens=1, **kw)  # noqa: E731
    off = ask(extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.usage.prompt_tokens == want(enable_thinking=False) > ask().usage.prompt_tokens == want()
    count = lambda thinking: httpx.post(server.url + "/v1/messages/count_tokens", json={  # noqa: E731
        "model": "tiny", "messages": hi, **({"thinking": thinking} if thinking else {})}).json()["input_tokens"]
    assert count({"type": "disabled"}) == want(enable_thinking=False) and count({"type": "enabled"}) == want()
    r = httpx.post(server.url + "/v1/responses", json={"model": "tiny", "input": "Hi", "max_output_tokens": 1,
                                                       "reasoning": {"effort": "max"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning.effort"
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": hi, "chat_template_kwargs": {"tools": []}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"


def test_tool_calls_and_reasoning_are_parsed(server):
    r = server.client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, temperature=0, max_tokens=60)
    msg = r.choices[0]
    assert msg.finish_reason == "tool_calls"
    call = msg.message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert msg.message.model_extra["reasoning_content"] == "The user wants the weather."


def test_tool_calls_stream_as_deltas(server):
    stream = server.client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, temperature=0,
                                                   max_tokens=60, stream=True)
    reasoning, calls, finish = "", [], None
    for chunk in stream:
        d = chunk.choices[0].delta
        reasoning += (d.model_extra or {}).get("reasoning_content") or ""
        calls += d.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert "The user wants the weather." in reasoning and finish == "tool_calls"
    assert calls[0].function.name == "get_weather" and calls[0].index == 0


def test_a_tool_result_round_trips_and_the_prefix_is_reused(server):
    """The conversation's state survives a side request in between (--sessions 2: it takes the
    other session), and the tool call re-rendered by the chat template reuses the first prompt."""
    first = server.client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, temperature=0, max_tokens=60)
    side = server.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "A title?"}],
                                                 max_tokens=3)
    assert side.usage.prompt_tokens_details.cached_tokens < 8
    call = first.choices[0].message.tool_calls[0]
    follow = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                    {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]
    r = server.client.chat.completions.create(model="tiny", messages=follow, tools=TOOLS, max_tokens=2)
    cached = r.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens - 1 and cached < r.usage.prompt_tokens


@pytest.mark.parametrize("body,status,param", [
    ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, 400, "temperature"),
    ({"messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 17}, 400, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": 5}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "top_p": 0}, 400, "top_p"),
    ({"messages": [{"role": "user", "content": "x " * 600}]}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 100000}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "model": "gpt-9"}, 404, "model"),
    ({"messages": []}, 400, "messages"),
])
def test_bad_requests_name_the_field(server, body, status, param):
    r = httpx.post(server.url + "/v1/chat/completions", json=body)
    assert r.status_code == status
    err = r.json()["error"]
    assert err["param"] == param and err["message"]
    assert "Traceback" not in r.text and "/" not in err["message"].split("(")[0]


def test_malformed_json_is_a_400_and_the_server_keeps_serving(server):
    r = httpx.post(server.url + "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    assert server.client.chat.completions.create(model="tiny", messages=ASK, max_tokens=1).usage.completion_tokens == 1


def test_a_client_that_disconnects_stops_its_generation(server):
    body = {"model": "tiny", "prompt": "a", "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 4:
                break
    t0 = time.time()
    r = server.client.completions.create(model="tiny", prompt="b", max_tokens=2, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 2 and time.time() - t0 < 5
    recent = httpx.get(server.url + "/v1/status").json()["recent_requests"]
    assert any(0 < x["generated"] < 400 for x in recent)


def test_a_side_request_is_answered_while_a_long_generation_goes_on(server):
    """--sessions 2: a title call takes the other session and its steps alternate with the
    long generation's, which is still running when it is answered, and ends whole."""
    body = {"model": "tiny", "prompt": "a", "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = (line for line in r.iter_lines() if line.startswith("data:"))
        next(lines)
        side = server.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "A title?"}],
                                                     max_tokens=3, extra_body={"ignore_eos": True})
        status = httpx.get(server.url + "/v1/status").json()
        rest = list(lines)
    assert side.usage.completion_tokens == 3 and status["queue"]["running"] == 1
    assert rest[-1] == "data: [DONE]" and len(rest) == 400
    assert json.loads(rest[-2][5:])["choices"][0]["finish_reason"] == "length"
    assert httpx.get(server.url + "/props").json()["total_slots"] == 2


def test_concurrent_requests_that_leave_early_leave_the_sessions_free(server):
    """Streams abandoned mid-way, n choices and plain requests at once on two sessions: each is
    answered (or refused with 429), and afterwards nothing runs or waits and a request is served."""
    def abandoned():
        body = {"model": "tiny", "prompt": "a", "max_tokens": 300, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i > 3:
                    return r.status_code
            return r.status_code
    chat = lambda: httpx.post(server.url + "/v1/chat/completions", timeout=60, json={  # noqa: E731
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 20, "n": 2, "ignore_eos": True}).status_code
    results = []
    threads = [threading.Thread(target=lambda f=f: results.append(f())) for f in (abandoned, chat, abandoned, chat)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(set(results)) in ([200], [200, 429]) and results.count(200) >= 2
    for _ in range(100):
        queue = httpx.get(server.url + "/v1/status").json()["queue"]
        if queue["running"] == queue["waiting"] == 0:
            break
        time.sleep(0.1)
    assert queue["running"] == queue["waiting"] == 0
    assert server.client.chat.completions.create(model="tiny", messages=ASK, max_tokens=2).usage.completion_tokens == 2


def test_a_full_queue_answers_429_with_retry_after(server):
    body = {"model": "tiny", "prompt": "a", "max_tokens": 300, "ignore_eos": True}
    results = []
    threads = [threading.Thread(target=lambda: results.append(httpx.post(server.url + "/v1/completions", json=body,
                                                                          timeout=60))) for _ in range(4)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join()
    codes = sorted(r.status_code for r in results)
    assert codes.count(200) >= 2 and 429 in codes
    rejected = next(r for r in results if r.status_code == 429)
    assert int(rejected.headers["retry-after"]) >= 1 and rejected.json()["error"]["type"] == "rate_limit_exceeded"


def test_status_and_metrics(server):
    status = httpx.get(server.url + "/v1/status").json()
    assert [line["name"] for line in status["ledger"]][:2] == ["other processes", "dense weights"]
    assert status["serve_check"]["status"] == "OK" and "layer_hit_rates" in status["expert_cache"]
    assert status["speculative"]["enabled"] is False and status["uptime_s"] > 0
    assert len(status["sessions"]) == 2 and sum(x["current"] for x in status["sessions"]) == 1
    assert next(x for x in status["sessions"] if x["current"])["tokens"] == status["kv_cache"]["tokens"]
    assert "2 sessions x 512 x" in next(x for x in status["ledger"] if x["name"] == "sequence state")["note"]
    assert set(status["prompt_product_ways"]) <= {"dots", "mkl", "onednn"}
    assert status["decode_graphs"] == {"on": False, "why_not": "--decode-graphs off"}
    text = httpx.get(server.url + "/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_count", "vllm:kv_cache_usage_perc", "moefit_expert_cache_slots",
                 "moefit_expert_cache_hits_total", "moefit_device_free_bytes", "moefit_guard_warnings_total"):
        assert name in text


def test_the_guard_shrinks_the_cache_and_it_grows_back(server):
    slots = lambda: httpx.get(server.url + "/v1/status").json()["expert_cache"]["slots"]  # noqa: E731
    ask = lambda: server.client.chat.completions.create(model="tiny", messages=ASK, max_tokens=2)  # noqa: E731
    full = slots()
    free = httpx.get(server.url + "/v1/status").json()["device_now"]["free_bytes"] / 2**20
    write_card(server.card, CARD["name"], CARD["total_mib"], DESKTOP + [(5000, "blender", free - 7.6)])
    ask()
    status = httpx.get(server.url + "/v1/status").json()
    assert status["guard"]["warnings"] >= 1 and status["expert_cache"]["slots"] < full
    assert any(e["kind"] == "shrink" for e in status["guard"]["events"])
    write_card(server.card, CARD["name"], CARD["total_mib"], DESKTOP)
    ask()
    assert slots() == full
    assert any(e["kind"] == "grow" for e in httpx.get(server.url + "/v1/status").json()["guard"]["events"])


def test_out_of_memory_mid_request_is_a_503_then_the_next_request_works(server):
    status = httpx.get(server.url + "/v1/status").json()
    free = status["device_now"]["free_bytes"] / 2**20
    write_card(server.card, CARD["name"], CARD["total_mib"], DESKTOP + [(6000, "game", free + 0.3)])
    with pytest.raises(openai.APIStatusError) as e:
        server.client.chat.completions.create(model="tiny", messages=ASK, max_tokens=2)
    assert e.value.status_code == 503 and "ran out of memory" in e.value.message
    write_card(server.card, CARD["name"], CARD["total_mib"], DESKTOP)
    assert server.client.chat.completions.create(model="tiny", messages=ASK, max_tokens=2).usage.completion_tokens == 2


def test_an_api_key_is_required_and_checked(model_pack, tmp_path):
    card = tmp_path / "card.json"
    write_card(card, CARD["name"], CARD["total_mib"], DESKTOP)
    s = Served(model_pack, card, tmp_path / "state", "--api-key", "s3cret")
    try:
        assert httpx.get(s.url + "/health").status_code == 200
        assert httpx.get(s.url + "/v1/models").status_code == 401
        bad = openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        good = openai.OpenAI(base_url=s.url + "/v1", api_key="s3cret", max_retries=0)
        assert good.chat.completions.create(model="tiny", messages=ASK, max_tokens=1).usage.completion_tokens == 1
    finally:
        s.stop()


def test_a_public_address_without_a_key_is_refused(model_pack):
    r = subprocess.run([sys.executable, "-m", "moefit", "serve", str(model_pack), "--host", "0.0.0.0"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "without an API key" in r.stderr


def test_keep_alive_comments_flow_while_a_request_waits(server):
    """Both sessions busy: the third request waits in the queue, its stream kept alive."""
    body = {"model": "tiny", "prompt": "a", "max_tokens": 300, "ignore_eos": True}
    busy = [threading.Thread(target=lambda: httpx.post(server.url + "/v1/completions", json=body, timeout=60))
            for _ in range(2)]
    for t in busy:
        t.start()
        time.sleep(0.2)
    lines = []
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"model": "tiny", "prompt": "b", "max_tokens": 2, "stream": True}) as r:
        lines = list(r.iter_lines())
    for t in busy:
        t.join()
    assert ": keep-alive" in lines and "data: [DONE]" in lines


def test_a_dirty_start_grows_back_and_the_history_says_so(model_pack, tmp_path):
    from moefit.memory.devices import open_device
    from moefit.ops import zerocheck
    from moefit.ops.history import History
    card = tmp_path / "card.json"
    write_card(card, CARD["name"], CARD["total_mib"], DESKTOP)
    zerocheck.save_baseline(tmp_path / "state", open_device(f"sim:{card}").snapshot())
    plan = json.loads(subprocess.run([sys.executable, "-m", "moefit", "plan", str(model_pack), "--json", "--device",
                                      f"sim:{card}", "--ctx", "512", "--vram-reserve-mib", "8"],
                                     capture_output=True, text=True).stdout)
    room = plan["ledger"][-1]["bytes"] + plan["expert_cache"]["used_bytes"]          # free + cache on a clean card
    old = (room - 4 * plan["expert_cache"]["largest_blob_bytes"]) / 2**20            # leaves about four experts
    write_card(card, CARD["name"], CARD["total_mib"], DESKTOP + [(7000, "old-moefit", old)])
    s = Served(model_pack, card, tmp_path / "state")
    try:
        started = httpx.get(s.url + "/v1/status").json()
        assert started["start"]["zero_check"]["verdict"] == "DIRTY"
        write_card(card, CARD["name"], CARD["total_mib"], DESKTOP)                 # the culprit exits
        httpx.post(s.url + "/v1/completions", json={"prompt": "a", "max_tokens": 1}, timeout=30)
        grown = httpx.get(s.url + "/v1/status").json()["expert_cache"]["slots"]
        assert grown > started["expert_cache"]["slots"]
    finally:
        assert "moefit: stopped" in s.stop()
    row = History(tmp_path / "state").rows()[-1]
    assert row["zero_check"] == "DIRTY" and row["slots_now"] == grown > row["slots"] and row["cache_resizes"] >= 1


def test_a_start_that_does_not_fit_is_refused_with_the_ledger_and_exit_3(model_pack, tmp_path):
    card = tmp_path / "card.json"
    write_card(card, CARD["name"], 40.0, DESKTOP)                       # the dense weights alone need ~38 MiB
    r = subprocess.run([sys.executable, "-m", "moefit", "serve", str(model_pack), "--port", "0", "--device",
                        f"sim:{card}", "--state-dir", str(tmp_path / "state"), "--settle-s", "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 3
    assert "refused:" in r.stderr and "dense weights" in r.stderr and "fixes:" in r.stderr
    assert "Traceback" not in r.stderr

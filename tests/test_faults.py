"""Nothing a client sends or a signal does may wedge the server: each case reproduced
against a real `moefit serve` process, then the server is asked to serve again."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from moefit.memory.simcard import write_card

from serving import Served

CARD = dict(name="RTX 4070 (simulated)", total_mib=120.0)
DESKTOP = [(2101, "gnome-shell", 10.0)]
HI = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.fixture(scope="module")
def server(packs, tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    card = root / "card.json"
    write_card(card, CARD["name"], CARD["total_mib"], DESKTOP)
    s = Served(packs("qwen3_moe", "int8"), card, root / "state", "--ctx", "4096", "--max-queue", "2")
    s.card = card
    yield s
    s.stop()


def post(server, path, body, **kw):
    return httpx.post(server.url + path, content=body if isinstance(body, bytes) else json.dumps(body).encode(),
                      headers={"content-type": "application/json", **kw.pop("headers", {})}, timeout=60, **kw)


def serves(server) -> bool:
    r = post(server, "/v1/chat/completions", HI)
    return r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1 and \
        httpx.get(server.url + "/health").status_code == 200


def test_a_seed_past_64_bits_is_a_400_and_the_engine_lives(server):
    r = post(server, "/v1/chat/completions", {**HI, "seed": 18446744073709551616})
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed"
    assert serves(server)


def test_an_unreadable_card_fails_one_request_with_503_and_the_next_is_served(server):
    server.card.write_text("{ half-written")
    try:
        r = post(server, "/v1/chat/completions", HI)
    finally:
        write_card(server.card, CARD["name"], CARD["total_mib"], DESKTOP)
    assert r.status_code == 503 and r.json()["error"]["code"] == "device_unavailable"
    assert serves(server)


@pytest.mark.parametrize("raw,needle", [
    (b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}', "surrogate"),
    (b'{"messages": ' + b"[" * 100000 + b"]" * 100000 + b"}", "nested deeper"),
    (b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', "NaN"),
    (b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}',
     "text only"),
])
def test_bodies_that_once_gave_500_are_400s(server, raw, needle):
    r = post(server, "/v1/chat/completions", raw)
    assert r.status_code == 400 and needle in r.json()["error"]["message"]
    assert serves(server)


def test_cross_site_requests_are_refused(server):
    evil = post(server, "/v1/chat/completions", HI, headers={"content-type": "text/plain",
                                                            "origin": "https://evil.example"})
    assert evil.status_code == 403 and evil.json()["error"]["code"] == "origin_not_allowed"
    plain = post(server, "/v1/chat/completions", HI, headers={"content-type": "text/plain"})
    assert plain.status_code == 415
    rebound = httpx.get(server.url + "/v1/models", headers={"host": f"evil.example:{server.port}"})
    assert rebound.status_code == 403 and rebound.json()["error"]["code"] == "bad_host"
    own = post(server, "/v1/chat/completions", HI, headers={"origin": server.url})
    assert own.status_code == 200


def test_a_non_streaming_client_that_hangs_up_cancels_its_job(server):
    body = json.dumps({"prompt": "a", "max_tokens": 4000, "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        time.sleep(1.0)
    t0 = time.time()
    assert serves(server) and time.time() - t0 < 10
    recent = httpx.get(server.url + "/v1/status").json()["recent_requests"]
    assert any(r["prompt_tokens"] == 1 and 0 < r["generated"] < 4000 for r in recent)


# -- fuzzing: generated bodies, bounded so that CI stays fast --------------------------------
ODD_TEXT = st.one_of(st.text(max_size=12), st.sampled_from(["\ud800", "a\udfff", "\x00", "💡", "<|im_end|>", ""]))
JSON_ANY = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | ODD_TEXT,
                        lambda c: st.lists(c, max_size=3) | st.dictionaries(ODD_TEXT, c, max_size=3), max_leaves=8)
LIMIT = st.one_of(st.integers(-2, 6), JSON_ANY.filter(lambda v: v is not None))   # never "no limit": bounded runs
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "robot"]),
                                 "content": st.one_of(ODD_TEXT, JSON_ANY)})
FIELDS = {"temperature": st.one_of(st.floats(-1, 3), JSON_ANY), "top_p": st.one_of(st.floats(-1, 2), JSON_ANY),
          "top_k": st.one_of(st.integers(-2, 50), JSON_ANY), "seed": st.one_of(st.integers(), JSON_ANY),
          "stop": st.one_of(ODD_TEXT, st.lists(ODD_TEXT, max_size=3), JSON_ANY), "stream": st.booleans(),
          "n": st.one_of(st.integers(-1, 3), JSON_ANY), "tools": JSON_ANY, "tool_choice": JSON_ANY,
          "presence_penalty": st.floats(-3, 3), "repetition_penalty": st.floats(-1, 11), "model": ODD_TEXT,
          "stream_options": JSON_ANY, "logprobs": JSON_ANY, "response_format": JSON_ANY}
CHAT = st.fixed_dictionaries({"messages": st.one_of(st.lists(MESSAGE, min_size=1, max_size=3), JSON_ANY),
                              "max_tokens": LIMIT},
                             optional=FIELDS)
COMPLETION = st.fixed_dictionaries({"prompt": st.one_of(ODD_TEXT, st.lists(st.integers(-5, 400), max_size=5), JSON_ANY),
                                    "max_tokens": LIMIT},
                                   optional={**FIELDS, "echo": JSON_ANY})
A_BLOCK = st.fixed_dictionaries({"type": st.sampled_from(["text", "tool_use", "tool_result", "thinking", "image"])},
                                optional={"text": ODD_TEXT, "id": ODD_TEXT, "name": ODD_TEXT, "input": JSON_ANY,
                                          "tool_use_id": ODD_TEXT, "content": JSON_ANY, "thinking": ODD_TEXT})
MESSAGES = st.fixed_dictionaries(
    {"max_tokens": LIMIT,
     "messages": st.one_of(st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]),
                                                           "content": st.one_of(ODD_TEXT, st.lists(A_BLOCK, max_size=3))}),
                                    min_size=1, max_size=3), JSON_ANY)},
    optional={"system": st.one_of(ODD_TEXT, JSON_ANY), "tools": JSON_ANY, "tool_choice": JSON_ANY,
              "stream": st.booleans(), "temperature": st.one_of(st.floats(-1, 2), JSON_ANY),
              "stop_sequences": JSON_ANY})
RESPONSES = st.fixed_dictionaries(
    {"max_output_tokens": LIMIT,
     "input": st.one_of(ODD_TEXT, st.lists(st.one_of(JSON_ANY, MESSAGE, st.fixed_dictionaries(
         {"type": st.sampled_from(["function_call", "function_call_output", "reasoning", "message", "web"]),
          "call_id": ODD_TEXT, "name": ODD_TEXT, "arguments": ODD_TEXT, "output": JSON_ANY})), max_size=3))},
    optional={"instructions": JSON_ANY, "tools": JSON_ANY, "tool_choice": JSON_ANY, "text": JSON_ANY,
              "stream": st.booleans(), "previous_response_id": JSON_ANY})
FUZZ = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def answered(server, path: str, body) -> int:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with httpx.stream("POST", server.url + path, content=raw, timeout=60,
                      headers={"content-type": "application/json"}) as r:
        text = "".join(r.iter_text())
    assert r.status_code < 500, (body, text)
    if r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"):
        assert text.rstrip().endswith("data: [DONE]")
    return r.status_code


@pytest.mark.parametrize("path,bodies", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION),
                                         ("/v1/messages", MESSAGES), ("/v1/responses", RESPONSES)],
                         ids=["chat", "completions", "anthropic", "responses"])
@FUZZ
@given(data=st.data())
def test_fuzzed_bodies_never_give_a_5xx(server, path, bodies, data):
    answered(server, path, data.draw(bodies))


@FUZZ
@given(raw=st.binary(max_size=64))
def test_fuzzed_bytes_never_give_a_5xx(server, raw):
    answered(server, "/v1/chat/completions", raw)


def test_the_server_serves_after_the_fuzzing(server):
    assert serves(server)


# -- memory: the guard grows the cache back on the demo's own card ---------------------------
def test_the_demo_cache_grows_back_after_a_program_and_an_oom_leave(tmp_path):
    from moefit.demo import CARD as DEMO_CARD, SIM_FLAGS, demo_pack
    card = tmp_path / "card.json"
    card.write_text(DEMO_CARD.read_text())
    s = Served(demo_pack(), card, tmp_path / "state", *SIM_FLAGS)
    status = lambda: httpx.get(s.url + "/v1/status").json()  # noqa: E731
    ask = lambda: post(s, "/v1/chat/completions", HI)  # noqa: E731
    try:
        full = status()["expert_cache"]["slots"]
        clean = json.loads(card.read_text())
        free = status()["device_now"]["free_bytes"] / 2**20
        take = lambda mib: card.write_text(json.dumps({**clean, "processes": clean["processes"] + [  # noqa: E731
            {"pid": 5000, "name": "blender", "used_mib": mib}]}))
        take(free - 0.5)
        assert ask().status_code == 200 and status()["expert_cache"]["slots"] < full
        card.write_text(json.dumps(clean))
        assert ask().status_code == 200 and status()["expert_cache"]["slots"] == full
        take(free + 2.5)                                  # more than giving back every slot frees
        assert ask().status_code == 503 and status()["expert_cache"]["slots"] < full
        card.write_text(json.dumps(clean))
        assert ask().status_code == 200 and status()["expert_cache"]["slots"] == full
    finally:
        s.stop()


# -- signals, ports, the history ----------------------------------------------------------
def test_sigterm_during_a_stream_ends_it_cleanly_and_records_the_run(packs, tmp_path):
    from moefit.ops.history import History
    card = tmp_path / "card.json"
    write_card(card, CARD["name"], CARD["total_mib"], DESKTOP)
    s = Served(packs("qwen3_moe", "int8"), card, tmp_path / "state", "--ctx", "4096")
    post(s, "/v1/completions", {"prompt": "a", "max_tokens": 20, "ignore_eos": True})     # a measured run first
    lines = []
    with httpx.stream("POST", s.url + "/v1/completions", timeout=60, headers={"content-type": "application/json"},
                      content=json.dumps({"prompt": "a", "max_tokens": 4000, "ignore_eos": True,
                                          "stream": True}).encode()) as r:
        for line in filter(None, r.iter_lines()):
            lines.append(line)
            if len(lines) == 10:
                s.proc.send_signal(signal.SIGTERM)
    out, err = s.proc.communicate(timeout=60)
    data = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert s.proc.returncode == 0, err
    assert lines[-1] == "data: [DONE]" and data[-1]["choices"][0]["finish_reason"] == "abort"
    assert "terminate called" not in err and "moefit: stopped" in err
    row = History(tmp_path / "state").rows()[-1]
    assert row["ended"] and row["decode_tokens_per_s"] > 0 and row["outcome"] == "started"


def test_a_port_in_use_is_exit_1_naming_the_holder(packs, tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "moefit", "serve", str(packs("qwen3_moe", "int8")), "--port",
                            str(port), "--device", "cpu"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert f"moefit: port {port} is in use (pid {os.getpid()}, " in r.stderr


def test_a_start_killed_with_9_is_recorded_as_killed(packs, tmp_path):
    card = tmp_path / "card.json"
    write_card(card, CARD["name"], CARD["total_mib"], DESKTOP)
    s = Served(packs("qwen3_moe", "int8"), card, tmp_path / "state")
    s.proc.kill()
    s.proc.wait(30)
    r = subprocess.run([sys.executable, "-m", "moefit", "history", "--json", "--state-dir", str(tmp_path / "state")],
                       capture_output=True, text=True)
    row = json.loads(r.stdout)["starts"][-1]
    assert row["outcome"] == "killed" and "without writing its final row" in row["message"]

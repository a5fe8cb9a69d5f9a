"""serve --keep-sessions (runtime/kept.py): a session written at the stop and taken back at the
next start gives its conversation's next turn the same tokens, with the same prefix reused, as
a server that never stopped; a file kept under other flags, or damaged, is left and the start
goes on; the server writes and takes back the files itself; a session copied into another (fork)
continues as the original."""

import httpx
import pytest

from moefit.config import ServeConfig
from moefit.memory.simcard import write_card
from moefit.runtime import kept
from moefit.runtime.engine import Engine
from moefit.runtime.sampler import SamplingParams
from serving import Served

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
MAIN = [5, 9, 17, 33, 65, 129, 7, 3, 150, 220, 31, 64] * 4


def next_turn(engine, reply):
    return engine.generate(MAIN + reply + [11, 12], GREEDY)[1]


@pytest.mark.parametrize("family,flags", [("qwen3_moe", {}), ("qwen3_5_moe", {"kv_dtype": "int8"}),
                                          ("gpt_oss", {"prefill_chunk": 16}),      # its sliding layers in rings,
                                          ("gpt_oss", {"prefill_chunk": 64}),      # wrapped, and not yet
                                          ("deepseek_v3", {"kv_dtype": "int8"})])
def test_a_kept_session_resumes_its_conversation_as_if_never_stopped(family, flags, packs, tmp_path):
    pack, cfg = packs(family), ServeConfig(ctx=128, **flags)
    before = Engine.open(pack, cfg)
    reply = before.generate(MAIN, GREEDY)[1].generated
    held = len(MAIN) + len(reply) - 1                              # the last token sampled was never fed
    said = kept.save(before, tmp_path)
    assert len(said) == 1 and said[0].startswith(f"session 0: {held} tokens kept")
    after = Engine.open(pack, cfg)
    assert kept.restore(after, tmp_path) == [f"session 0: {held} tokens taken back"]
    assert (family == "gpt_oss") == any(getattr(layer, "slot_pos", None) is not None for layer in after.session.state.layers)
    resumed, continued = next_turn(after, reply), next_turn(before, reply)
    fresh = next_turn(Engine.open(pack, cfg), reply)               # a server that kept nothing
    assert resumed.cached_tokens == continued.cached_tokens == held and fresh.cached_tokens == 0
    assert resumed.generated == continued.generated == fresh.generated


@pytest.mark.parametrize("family,flags", [("qwen3_moe", {}), ("qwen3_5_moe", {"kv_dtype": "int8"}),
                                          ("gpt_oss", {"prefill_chunk": 16}), ("deepseek_v3", {"kv_dtype": "int8"})])
def test_a_forked_session_continues_as_the_one_it_copies(family, flags, packs):
    """kept.fork (serve's copy of a session into another): the copy's next turn reuses as much
    and gives the same tokens as the original's, and the original is untouched."""
    engine = Engine.open(packs(family), ServeConfig(ctx=128, sessions=2, **flags))
    reply = engine.generate(MAIN, GREEDY)[1].generated
    source, target = engine.session, next(s for s in engine.sessions if s is not engine.session)
    assert engine.fork(source, target) == len(MAIN) + len(reply) - 1 and target.tokens == source.tokens
    turn = MAIN + reply + [11, 12]
    copy = [e.token for e in engine.stream(turn, GREEDY, session=target)]
    assert target.last.cached_tokens == len(MAIN) + len(reply) - 1
    original = [e.token for e in engine.stream(turn, GREEDY, session=source)]
    assert copy == original and source.last.cached_tokens == target.last.cached_tokens


def test_a_hybrid_resumes_at_the_last_prompts_end_when_the_reply_was_rewritten(packs, tmp_path):
    """A chat template that drops the reply's thinking: the next turn shares only the last prompt,
    and the DeltaNet layers resume at its end, from the mark kept with the session."""
    pack, cfg = packs("qwen3_5_moe"), ServeConfig(ctx=128)
    before = Engine.open(pack, cfg)
    before.generate(MAIN, GREEDY)
    kept.save(before, tmp_path)
    after = Engine.open(pack, cfg)
    kept.restore(after, tmp_path)
    rewritten = MAIN + [77, 78, 79]
    resumed = after.generate(rewritten, GREEDY)[1]
    assert resumed.cached_tokens == len(MAIN)
    assert resumed.generated == Engine.open(pack, cfg).generate(rewritten, GREEDY)[1].generated
    again = Engine.open(pack, cfg)                                 # the same prompt again: nothing runs
    kept.restore(again, tmp_path)
    assert again.generate(MAIN, GREEDY)[1].cached_tokens == len(MAIN)


def test_a_file_kept_under_other_flags_or_damaged_is_left(packs, tmp_path):
    pack = packs("qwen3_moe")
    engine = Engine.open(pack, ServeConfig(ctx=128))
    engine.generate(MAIN, GREEDY)
    kept.save(engine, tmp_path)
    other = Engine.open(pack, ServeConfig(ctx=128, kv_dtype="int8"))
    assert kept.restore(other, tmp_path) == ["session 0: left: kept under another version, pack or flags"]
    assert other.generate(MAIN, GREEDY)[1].cached_tokens == 0
    (tmp_path / "session-0.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken}")
    same = Engine.open(pack, ServeConfig(ctx=128))
    said = kept.restore(same, tmp_path)
    assert len(said) == 1 and said[0].startswith("session 0: left: unreadable")
    assert same.generate(MAIN, GREEDY)[1].generated == engine.generate(MAIN, GREEDY)[1].generated


def test_only_sessions_holding_tokens_are_kept(packs, tmp_path):
    pack = packs("qwen3_moe")
    engine = Engine.open(pack, ServeConfig(ctx=128, sessions=2))
    engine.generate(MAIN, GREEDY)
    (tmp_path / "session-1.safetensors").write_bytes(b"an old file")
    assert [line.split(":")[0] for line in kept.save(engine, tmp_path)] == ["session 0"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["session-0.safetensors"]


def test_the_server_keeps_its_sessions_across_a_restart(packs, tmp_path):
    card = tmp_path / "card.json"
    write_card(card, "RTX 4070 (simulated)", 120.0, [])
    pack, state = packs("qwen3_moe"), tmp_path / "state"
    first = Served(pack, card, state, "--keep-sessions")
    body = {"prompt": MAIN, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    reply = httpx.post(first.url + "/v1/completions", json=body, timeout=60).json()
    err = first.stop()
    assert f"session 0: {len(MAIN) + 5} tokens kept" in err, err
    second = Served(pack, card, state, "--keep-sessions")
    try:
        text = reply["choices"][0]["text"]
        assert text and reply["usage"]["completion_tokens"] == 6
        body = {"prompt": MAIN + [11, 12], "max_tokens": 2, "temperature": 0}
        usage = httpx.post(second.url + "/v1/completions", json=body, timeout=60).json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= len(MAIN)
    finally:
        err = second.stop()
    assert f"session 0: {len(MAIN) + 5} tokens taken back" in err, err

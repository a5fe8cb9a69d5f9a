"""Speculative decoding: lossless for greedy, the sampling rule keeps the distribution,
paid for from the reserve, and the window backs off when drafts do not pay."""

import pytest
import torch

from moefit.config import ServeConfig
from moefit.runtime.engine import Engine
from moefit.runtime.sampler import SamplingParams
from moefit.runtime.sampler import Sampler, uniform
from moefit.runtime.speculative import NgramIndex, Window

from conftest import FAMILIES
import tiny

GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
# A prompt that repeats itself, so prompt lookup has something to propose.
PROMPT = [5, 17, 42, 99, 7, 3, 150, 220, 31, 64] * 4 + [5, 17, 42]


def run(pack, prompt=PROMPT, params=GREEDY, **flags):
    engine = Engine.open(pack, ServeConfig(**{"ctx": 128, **flags}))
    return engine, engine.generate(prompt, params)[1].generated


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_lookup_keeps_greedy_output(family, packs):
    plain, want = run(packs(family, "int8"))
    engine, got = run(packs(family, "int8"), spec="lookup", spec_window=4)
    n = until_a_tie(plain, PROMPT, want)
    assert got[:n] == want[:n] and n >= 10
    assert engine.spec_stats.windows > 0 and engine.spec_stats.drafted > 0


@pytest.mark.parametrize("device", ["cpu", "sim"])
def test_prompt_lookup_keeps_greedy_output_through_a_sliding_layers_ring(device, packs, card):
    """gpt-oss's sliding layers in rings of 24 slots (window 8, chunk 16): verify windows write
    slots their rejected tails keep until later positions take them; 40 tokens wrap the ring."""
    flags = {"prefill_chunk": 16}
    if device == "sim":
        flags.update(device=f"sim:{card(256)}", vram_reserve_mib=8, low_headroom_mib=0, min_expert_slots=0)
    plain, want = run(packs("gpt_oss", "int8"), **flags)
    engine, got = run(packs("gpt_oss", "int8"), spec="lookup", spec_window=4, **flags)
    assert any(layer.slot_pos is not None for layer in engine.session.state.layers)
    n = until_a_tie(run(packs("gpt_oss", "int8"), params=GREEDY)[0], PROMPT, want)     # one forward: no ring
    assert got[:n] == want[:n] and n >= 10
    assert engine.spec_stats.windows > 0 and engine.spec_stats.accepted < engine.spec_stats.drafted


def until_a_tie(engine, prompt, tokens, gap: float = 1e-3) -> int:
    """How many of the greedy tokens are decided by more than `gap` between the top two
    logits (teacher-forced): a verify window computes its rows batched, a plain step one at a
    time, and their float rounding may differ by ~1e-4 (int8 activations per row), so a token
    decided by less can go either way. Every other token must agree."""
    logits = engine.forward(prompt + tokens, 0)[len(prompt) - 1:-1]
    top = torch.topk(logits, 2).values
    close = ((top[:, 0] - top[:, 1]) < gap).nonzero()
    return int(close[0]) if len(close) else len(tokens)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_is_unchanged_across_a_prompt_reuse_boundary_and_at_the_context_end(family, packs):
    pack = packs(family, "int8")
    plain = Engine.open(pack, ServeConfig(ctx=64))
    spec = Engine.open(pack, ServeConfig(ctx=64, spec="lookup", spec_window=3))
    first = PROMPT[:20]
    for engine in (plain, spec):
        engine.generate(first, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    second = first + plain.last.generated + [7, 3]
    long = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)          # runs into the context end
    outs = [e.generate(second, long)[1] for e in (plain, spec)]
    assert outs[1].cached_tokens > 0 and outs[0].generated == outs[1].generated
    assert len(second) + len(outs[1].generated) == 64


def test_a_trained_draft_head_keeps_greedy_output(checkpoints, tmp_path):
    from moefit.pack.convert import convert
    from moefit.runtime import draft_head
    convert(checkpoints["qwen3_moe"], tmp_path / "pack", "int8", progress=False)
    base = Engine.open(tmp_path / "pack", ServeConfig(ctx=256))
    corpus = base.codec.encode(" ".join(tiny.CORPUS))
    head = draft_head.train(base, corpus, heads=3, steps=60)
    draft_head.save(tmp_path / "pack", head, {"steps": 60})
    _, want = run(tmp_path / "pack")
    engine, got = run(tmp_path / "pack", spec="head", spec_window=3)
    assert engine.spec_mode == "head" and got == want
    assert engine.spec_stats.windows > 0


def test_the_draft_head_is_paid_for_from_the_reserve(checkpoints, tmp_path, card):
    from moefit.memory import ledger as L
    from moefit.pack.convert import convert
    from moefit.runtime import draft_head
    convert(checkpoints["mixtral"], tmp_path / "pack", "int8", progress=False)
    base = Engine.open(tmp_path / "pack", ServeConfig(ctx=256))
    draft_head.save(tmp_path / "pack", draft_head.train(base, list(range(3, 300)) * 3, 2, 5), {})
    sim = dict(device=f"sim:{card(64)}", ctx=64, low_headroom_mib=0, min_expert_slots=0, spec="head", prefill_chunk=64)
    engine = Engine.open(tmp_path / "pack", ServeConfig(vram_reserve_mib=2, **sim))
    plan = engine.loaded.plan
    assert engine.spec_mode == "head" and plan.reserve.draft == 2 * (64 * 64 + 64) * 4
    assert engine.loaded.mem.charged[L.RESERVE] == plan.reserve.draft
    small = Engine.open(tmp_path / "pack", ServeConfig(vram_reserve_mib=0, **sim))
    assert small.spec_mode == "off" and "short" in small.spec_reason and "a reserve of" in small.spec_reason
    status = __import__("moefit.runtime.report", fromlist=["x"]).status_json(small)
    assert status["speculative"]["enabled"] is False and "short" in status["speculative"]["reason"]


def test_a_seeded_draw_follows_the_distribution_and_never_takes_a_zero():
    p = torch.tensor([0.5, 0.2, 0.0, 0.2, 0.1])
    sampler = Sampler(SamplingParams(seed=3), [1], 5)
    counts = torch.zeros(5)
    for i in range(20000):
        sampler.index = i
        counts[sampler.draw(p)] += 1
    assert counts[2] == 0 and torch.allclose(counts / 20000, p, atol=0.015)
    assert uniform(3, 7) == uniform(3, 7) != uniform(4, 7)


@pytest.mark.parametrize("spec", ["lookup", "head"])
def test_a_seed_gives_the_same_text_with_and_without_speculation(spec, checkpoints, tmp_path):
    from moefit.pack.convert import convert
    from moefit.runtime import draft_head
    convert(checkpoints["qwen3_moe"], tmp_path / "pack", "int8", progress=False)
    if spec == "head":
        base = Engine.open(tmp_path / "pack", ServeConfig(ctx=256))
        draft_head.save(tmp_path / "pack", draft_head.train(base, base.codec.encode(" ".join(tiny.CORPUS)), 3, 40), {})
    seeded = SamplingParams(max_tokens=40, temperature=0.7, seed=2**64 - 5, ignore_eos=True)
    _, want = run(tmp_path / "pack", params=seeded)
    engine, got = run(tmp_path / "pack", params=seeded, spec=spec, spec_window=3)
    assert engine.spec_stats.windows > 0 and got == want
    _, other = run(tmp_path / "pack", params=SamplingParams(**{**seeded.__dict__, "seed": 11}))
    assert other != want


@pytest.mark.parametrize("temperature", [0, 0.7])
def test_a_logit_bias_is_drawn_alike_with_and_without_speculation(temperature, packs):
    """The bias is the sampler's: a verify window's positions are drawn from biased logits too.
    Banning the plain output's first tokens changes it; the same bias with windows gives the same."""
    params = SamplingParams(max_tokens=30, temperature=temperature, seed=5, ignore_eos=True)
    _, plain = run(packs("qwen3_moe", "int8"), params=params)
    biased = SamplingParams(**{**params.__dict__, "logit_bias": ((plain[0], -100.0), (plain[1], -100.0), (7, 2.0))})
    _, want = run(packs("qwen3_moe", "int8"), params=biased)
    engine, got = run(packs("qwen3_moe", "int8"), params=biased, spec="lookup", spec_window=4)
    assert want[0] != plain[0] and plain[0] not in want and plain[1] not in want
    assert engine.spec_stats.windows > 0 and got == want


def test_the_window_turns_off_when_nothing_is_accepted_and_probes_later():
    w = Window(k_max=4, cooldown=3)
    assert w.size() == 0                                   # first a plain step, to know what a window costs
    w.record_plain(0.01)
    sizes = []
    for _ in range(20):
        k = w.size()
        sizes.append(k)
        if k:
            w.record(k, accepted=0, seconds=0.01, distinct_experts=10, misses=5)
    assert sizes[0] == 4 and 0 in sizes and min(s for s in sizes if s) == 1
    w2 = Window(k_max=4, k=2)
    w2.record_plain(0.01)
    w2.record(2, accepted=2, seconds=0.01, distinct_experts=6, misses=1)
    assert w2.k == 3
    w3 = Window(k_max=4)                                   # windows that cost more than they give
    w3.record_plain(0.01)
    for _ in range(6):
        if w3.size():
            w3.record(w3.k, accepted=1, seconds=0.05, distinct_experts=20, misses=12)
    assert w3.k < 4


def test_lookup_finds_the_latest_earlier_continuation():
    ix = NgramIndex()
    assert ix.draft([1, 2, 3, 4, 1, 2], 2) == [3, 4]
    assert ix.draft([1, 2, 3, 4, 1, 2, 9], 2) == []


def test_generate_json_reports_speculation(packs):
    import json
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "moefit", "generate", str(packs("olmoe", "int8")), "--prompt",
                        "the lantern burns the lantern burns the lantern", "--max-tokens", "12", "--spec", "lookup",
                        "--json", "--ignore-eos"], capture_output=True, text=True)
    spec = json.loads(r.stdout)["speculative"]
    assert r.returncode == 0 and spec["mode"] == "lookup" and spec["windows"] >= 1
    assert {"accepted", "drafted", "acceptance_rate", "distinct_experts_per_window"} <= set(spec)


def test_decoding_works_on_the_session(packs):
    """The session holds what a request leaves: its tokens (whose state is kept), the window's
    statistics and the request's figures; the engine's old names read the same objects."""
    engine, got = run(packs("qwen3_moe", "int8"), spec="lookup", spec_window=4)
    s = engine.session
    assert s.state is engine.loaded.kv and s.tokens is engine.kv_tokens and s.last is engine.last
    assert s.tokens == (PROMPT + got)[:len(PROMPT) + len(got) - 1]       # the last token has not run yet
    assert s.last.generated == got and s.spec_stats.windows > 0 and s.spec_stats is engine.spec_stats
    assert s.last_hidden is not None and s.last_hidden.shape == (engine.pack.model.hidden_size,)

"""Look-ahead: the next layer's experts predicted by its own router, scored, prefetched into
the cache; output unchanged with prefetch on or off; no pack serves blind."""

import json
import subprocess
import sys

import pytest
import torch

from moefit.config import ServeConfig
from moefit.experts.lookahead import LookAhead
from moefit.runtime.engine import Engine
from moefit.runtime.report import cache_json
from moefit.runtime.sampler import SamplingParams

from conftest import FAMILIES

GREEDY = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
PROMPT = [5, 17, 42, 99, 7, 3, 150, 220, 31, 64, 12, 8]


def sim(card_path, **flags) -> ServeConfig:
    return ServeConfig(**{"device": f"sim:{card_path}", "ctx": 64, "vram_reserve_mib": 1, "low_headroom_mib": 0,
                          "min_expert_slots": 0, **flags})


def test_predictions_are_ranked_scored_and_prefetch_hits_counted():
    ahead = LookAhead(num_layers=3, budget=2, top_k=2)
    assert ahead.expect(1, [[4, 2, 9, 5], [4, 7, 8, 9]]) == [4, 2, 7, 9, 8, 5]   # first choices first
    ahead.fetched_for(1, 7)
    ahead.score(1, [2, 7, 9], [7, 9])                  # 9 was only a third choice: not foreseen
    assert ahead.recall() == 2 / 3 and ahead.prefetch_hits == 1 and ahead.prefetched == 1
    ahead.score(2, [1], [1])                                             # no prediction: not scored
    assert ahead.layer_recall() == [None, 2 / 3, None]


@pytest.mark.parametrize("family", FAMILIES)
def test_prefetch_keeps_greedy_output_and_reports_itself(family, packs, card):
    pack = packs(family, "int8")
    path = card(64)
    outs, caches = [], []
    for n in (0, 2):
        engine = Engine.open(pack, sim(path, expert_cache="3", prefetch_per_layer=n))
        outs.append(engine.generate(PROMPT, GREEDY)[1].generated)
        caches.append(cache_json(engine))
    assert outs[0] == outs[1]
    off, on = caches
    assert off["prefetched"] == 0 and off["prediction_recall"] is None
    assert on["prefetched"] > 0 and 0 <= on["prefetch_hits"] <= on["prefetched"]
    assert 0 < on["prediction_recall"] <= 1 and on["slots"] <= 3 + 1
    assert on["used_bytes"] <= on["budget_bytes"]


def test_the_cpu_device_does_not_look_ahead(packs):
    engine = Engine.open(packs("olmoe", "int8"), ServeConfig(ctx=64))
    engine.generate(PROMPT, GREEDY)
    assert cache_json(engine)["prediction_recall"] is None


def test_routing_dumps_carry_the_prediction(packs, card, tmp_path):
    dump = tmp_path / "routing.jsonl"
    r = subprocess.run([sys.executable, "-m", "moefit", "generate", str(packs("qwen3_moe", "int8")), "--prompt", "the",
                        "--max-tokens", "4", "--device", f"sim:{card(64)}", "--ctx", "64", "--vram-reserve-mib", "1",
                        "--low-headroom-mib", "0", "--min-expert-slots", "0", "--expert-cache", "3", "--settle-s", "0",
                        "--state-dir", str(tmp_path / "state"), "--dump-routing", str(dump), "--json"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in dump.read_text().splitlines()]
    later = [row for row in rows if row["layer"] > min(r["layer"] for r in rows)]
    assert later and all(len(row["predicted"]) == 2 * len(row["experts"]) for row in later)   # 2k ranked
    assert "prediction_recall" in json.loads(r.stdout)["expert_cache"]


def test_a_pack_without_a_profile_says_what_it_costs_and_a_profiled_one_does_not(checkpoints, card, tmp_path):
    run = lambda *a: subprocess.run([sys.executable, "-m", "moefit", *a], capture_output=True, text=True)  # noqa: E731
    pack = tmp_path / "pack"
    packed = run("pack", str(checkpoints["mixtral"]), "-o", str(pack), "--quant", "int8")
    assert "no expert profile yet" in packed.stdout
    flags = ("--device", f"sim:{card(64)}", "--ctx", "64", "--vram-reserve-mib", "1", "--low-headroom-mib", "0",
             "--min-expert-slots", "0", "--expert-cache", "4")
    blind = json.loads(run("plan", str(pack), "--json", *flags).stdout)["serve_check"]["message"]
    assert "no expert profile" in blind and "% of routings" in blind
    (tmp_path / "prompts.txt").write_text("the lantern\na river runs\n")
    assert run("profile", str(pack), "--prompts", str(tmp_path / "prompts.txt")).returncode == 0
    assert "no expert profile" not in json.loads(run("plan", str(pack), "--json", *flags).stdout)["serve_check"]["message"]


def test_the_demo_pack_carries_the_shipped_profile():
    from moefit.demo import PROFILE, demo_pack
    from moefit.pack.reader import Pack
    assert PROFILE.exists()
    counts = json.loads(PROFILE.read_text())["counts"]
    assert sum(map(sum, counts)) > 0
    assert Pack.open(demo_pack(), checksums=False).profile_path.exists()


def test_handoffs_are_one_host_call_per_moe_layer_per_forward(packs, card):
    engine = Engine.open(packs("mixtral", "int8"), sim(card(64), expert_cache="3"))
    engine.generate(PROMPT, GREEDY)
    c = cache_json(engine)
    forwards = engine.forwards
    layers = len(engine.pack.model.moe_layers)
    assert engine.runner.handoffs == forwards * layers
    assert c["handoffs_per_token"] == pytest.approx(forwards * layers / engine.runner.tokens)
    assert 0 < c["handoffs_per_moe_layer_token"] <= 1


@pytest.mark.parametrize("family, own_waits", [("mixtral", 0), ("qwen3_moe", 1)])
def test_the_next_layers_guess_rides_the_hand_off_of_the_layer_computing_now(family, own_waits, packs, card):
    """No wait of its own for the look-ahead's ids, except where the layer computing now is dense
    (the tiny Qwen3-MoE's layer 1: its guess for layer 2 has no hand-off to ride)."""
    engine = Engine.open(packs(family, "int8"), sim(card(64), expert_cache="3", prefetch_per_layer=2))
    handoff, fetched, carried = engine.runner.handoff, [], []
    fetch, send = handoff.fetch, handoff.send
    handoff.fetch = lambda t: fetched.append(t) or fetch(t)
    handoff.send = lambda x, ids, w, guess=None: carried.append(guess is not None) or send(x, ids, w, guess)
    engine.generate(PROMPT, GREEDY)
    moe = engine.pack.model.moe_layers
    assert len(fetched) == own_waits * engine.forwards
    assert sum(carried) == engine.forwards * (len(moe) - 1 - own_waits)   # each MoE layer but the last guesses ahead
    assert engine.runner.ahead.predicted and engine.runner.ahead.prefetched > 0


def test_the_prefetch_budget_is_what_pcie_moves_in_a_layers_time():
    from moefit.experts.lookahead import LookAhead
    ahead = LookAhead(num_layers=4, budget=3)
    blob = 2_500_000
    assert ahead.pcie_budget(25e9, blob, now=0.0) == 3                # no layer time yet: the flag's
    assert ahead.pcie_budget(25e9, blob, now=0.001) == 3              # 1 ms: 10 blobs' worth, capped at 3
    ahead = LookAhead(num_layers=4, budget=3)
    ahead.pcie_budget(5e9, blob, now=0.0)
    assert ahead.pcie_budget(5e9, blob, now=0.001) == 2               # 1 ms at 5 GB/s: two blobs
    assert ahead.pcie_budget(0.0, blob, now=0.002) == 3               # no PCIe rate: the flag's
    assert ahead.to_json()["layer_ms"] > 0


def test_a_prefetch_keeps_what_the_layer_computing_now_routed_to_and_the_first_k_of_the_guess():
    ahead = LookAhead(num_layers=4, budget=2, top_k=2)
    ahead.expect(2, [[5, 6, 7, 8]])                       # ranks 3 and 4 may be brought in, not protected
    assert ahead.wanted(2, 1, [3, 4]) == {(1, 3), (1, 4), (2, 5), (2, 6)}
    assert ahead.next_guessed(1) == 2 and ahead.next_guessed(2) == -1


def test_the_previous_routing_ranks_after_the_guess_and_the_first_moe_layer_is_guessed_from_it():
    ahead = LookAhead(num_layers=4, budget=4, top_k=2, moe_layers=[1, 2, 3])
    ahead.score(2, [0, 3, 9], [9, 3])                     # layer 2's last token went to 9 and 3
    assert ahead.expect(2, [[5, 9, 7, 8]]) == [5, 9, 3, 7, 8]          # first k, then recency, then the rest
    assert ahead.wanted(2, 1, [4]) == {(1, 4), (2, 5), (2, 9), (2, 3)}
    assert ahead.next_guessed(1) == 2 and ahead.next_guessed(2) == -1   # layer 1 has no routing yet
    ahead.score(1, [6, 1], [1, 6])
    assert ahead.next_guessed(3) == 1 and ahead.predicted[1] == [1, 6]  # after the last layer: the first's recency
    ahead.fetched_for(1, 6)
    ahead.score(1, [6, 2], [6, 2])
    assert ahead.prefetch_hits == 1 and ahead.recall() == 0.0 and ahead.layer_recall()[1] is None


def test_the_first_moe_layers_last_routing_is_resident_before_the_next_token(packs, card):
    engine = Engine.open(packs("qwen3_moe", "int8"), sim(card(64), expert_cache="6", prefetch_per_layer=2))
    engine.generate(PROMPT, GREEDY)
    first = engine.pack.model.moe_layers[0]
    recent = engine.runner.ahead.recent[first]
    assert recent and all((first, e) in engine.runner.slots for e in recent)


class _Stack:
    """Two router layers, as decoder_stack shows them to ProbeFit."""

    def __init__(self, routers):
        from types import SimpleNamespace
        e = routers[0].shape[1]
        self.layers = [{"router": r, "post_norm": torch.ones(e)} for r in routers]
        self.cfg = SimpleNamespace(rms_norm_eps=1e-6)


def _fit(mix: torch.Tensor, prompts: int = 10):
    """Layer 1's MLP input is layer 0's residual mixed by `mix`: the router alone misreads it."""
    from moefit.experts.probe import ProbeFit
    torch.manual_seed(0)
    e, n = mix.shape[0], 16
    model = _Stack([torch.randn(n, e), torch.randn(n, e)])
    fit = ProbeFit(top_k=2)
    for p in range(prompts):
        fit.begin(p)
        x = torch.randn(40, e)
        fit.see(model, 0, x, x)
        feat = torch.nn.functional.rms_norm(x, (e,), eps=1e-6)
        fit.see(model, 1, feat @ mix.T, feat @ mix.T)
    return fit.fit(model)


def test_the_probe_learns_a_routing_the_router_misreads_and_keeps_the_router_where_it_reads_right():
    torch.manual_seed(1)
    e = 32
    mixed = _fit(torch.eye(e) + 0.8 * torch.randn(e, e))
    assert mixed.held_out == 80 and mixed.tokens == 320                     # prompts 4 and 9 score the fit
    assert mixed.router_recall[1] < 0.6 and mixed.probe_recall[1] > 0.95 and 1 in mixed.matrices
    plain = _fit(torch.eye(e))                                              # the router is the exact map
    assert plain.router_recall[1] == 1.0 and plain.matrices == {}


def test_a_fitted_probe_is_stored_placed_in_the_dense_line_and_guesses(packs, card, tmp_path):
    import shutil
    from moefit.memory import ledger as L
    pack = tmp_path / "pack"
    shutil.copytree(packs("qwen3_moe", "int8"), pack)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(f"the lantern {i} and the river {i * 7}" for i in range(10)) + "\n")
    r = subprocess.run([sys.executable, "-m", "moefit", "profile", str(pack), "--prompts", str(prompts),
                        "--max-tokens", "24", "--probe"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "look-ahead probe:" in r.stdout and "held out" in r.stdout
    info = json.loads((pack / "moefit-pack.json").read_text()).get("probe")
    assert info and info["layers"], r.stdout                                # the tiny model's probe beats its router
    assert (pack / info["file"]).stat().st_size == 4 * info["params"]
    assert all(info["probe_recall"][str(j)] > info["router_recall"][str(j)] for j in info["layers"])
    runs = {}
    for n in (0, 2):
        engine = Engine.open(pack, sim(card(64), expert_cache="3", prefetch_per_layer=n))
        runs[n] = engine, engine.generate(PROMPT, GREEDY)[1].generated
    (off, out_off), (on, out_on) = runs[0], runs[2]
    assert out_on == out_off                                                # placement only, never the tokens
    assert sorted(on.loaded.model.probes) == info["layers"] and off.loaded.model.probes == {}
    cb = on.loaded.model.norm.element_size()
    dense = lambda e: e.loaded.mem.charged[L.DENSE]                         # noqa: E731
    assert dense(on) - dense(off) == info["params"] * cb
    assert dense(on) == on.loaded.plan.line(L.DENSE).bytes                  # the ledger holds it, exactly
    assert cache_json(on)["predictor"] == f"probe on {len(info['layers'])} layers"


def test_the_demo_pack_carries_the_shipped_probe():
    from moefit.demo import PROBE_SECTION, demo_pack
    from moefit.pack.reader import Pack
    shipped = json.loads(PROBE_SECTION.read_text())
    assert all(shipped["probe_recall"][str(j)] > shipped["router_recall"][str(j)] for j in shipped["layers"])
    assert Pack.open(demo_pack(), checksums=False).header["probe"]["layers"] == shipped["layers"]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_probe_fits_every_family_and_is_kept_only_where_it_beats_the_router(family, packs):
    from moefit.experts.probe import ProbeFit
    engine = Engine.open(packs(family, "int8"), ServeConfig(ctx=256))
    model, m = engine.loaded.model, engine.pack.model
    fit = model.probe_fit = ProbeFit(m.top_k)
    for n in range(10):                                     # prompts 4 and 9 are held out
        fit.begin(n)
        engine.generate([5 + n, 17, 42, 99, 7 * n + 1, 3], SamplingParams(max_tokens=20, temperature=0,
                                                                          ignore_eos=True))
    probe = fit.fit(model)
    guessed = [j for j in m.moe_layers if j >= 1]                   # a layer before it to guess from
    assert sorted(probe.router_recall) == guessed and probe.held_out == 2 * (6 + 19)     # the last token is not run
    assert probe.matrices and all(probe.probe_recall[j] > probe.router_recall[j] for j in probe.matrices)
    assert all(w.shape == (m.num_experts, m.hidden_size) for w in probe.matrices.values())

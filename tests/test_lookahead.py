"""Look-ahead: the next layer's experts predicted by its own router, scored, prefetched into
the cache; output unchanged with prefetch on or off; no pack serves blind."""

import json
import subprocess
import sys

import pytest

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
    ahead.score(1, [2, 7, 9])                          # 9 was only a third choice: not foreseen
    assert ahead.recall() == 2 / 3 and ahead.prefetch_hits == 1 and ahead.prefetched == 1
    ahead.score(2, [1])                                                  # no prediction: not scored
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

"""The expert cache on a simulated card: output does not depend on the cache size, the
ledger's bytes are the bytes charged, and a card that fills up mid-start is handled."""

import numpy as np
import pytest

from moefit.config import ServeConfig
from moefit.errors import RefusedError
from moefit.experts.cache import CacheBook, SwapPolicy, fill
from moefit.memory import ledger as L
from moefit.runtime.engine import Engine
from moefit.runtime.sampler import SamplingParams

from conftest import FAMILIES

PROMPT = [5, 17, 42, 99, 7, 3, 150, 220, 31, 64, 12, 8]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def sim(card_path, **flags) -> ServeConfig:
    base = dict(device=f"sim:{card_path}", ctx=64, vram_reserve_mib=1, low_headroom_mib=0, min_expert_slots=0)
    return ServeConfig(**{**base, **flags})


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_do_not_depend_on_the_cache(family, packs, card):
    pack = packs(family, "int8")
    path = card(64)
    want = Engine.open(pack, ServeConfig(ctx=64)).generate(PROMPT, GREEDY)[1].generated   # plain cpu
    for cache in ("0", "3", "auto"):
        engine = Engine.open(pack, sim(path, expert_cache=cache))
        slots = len(engine.runner.slots)
        assert slots == {"0": 0, "3": 3, "auto": len(engine.pack.blobs)}[cache]      # auto: every expert fits
        assert engine.generate(PROMPT, GREEDY)[1].generated == want, f"cache {cache}"


@pytest.mark.parametrize("family", ["mixtral", "qwen3_5_moe", "deepseek_v3", "gpt_oss"])
def test_planned_bytes_are_the_bytes_charged_to_the_card(family, packs, card):
    """Each kind of sequence state (KV, DeltaNet state + snapshot, MLA latent, sliding rings of
    window + chunk) is allocated exactly as the family declares it."""
    path = card(16, [(100, "desktop", 3.5)])
    engine = Engine.open(packs(family, "int4"), sim(path, expert_cache="10", prefill_chunk=16))
    plan = engine.loaded.plan
    charged = engine.loaded.mem.charged
    for name in (L.DENSE, L.KV, L.CACHE):
        assert charged[name] == plan.line(name).bytes, name
    assert charged[L.RESERVE] == 0                     # free memory held back, not an allocation
    assert engine.loaded.mem.snapshot().free_bytes == plan.line(L.FREE).bytes + plan.reserve.total
    engine.generate(PROMPT, GREEDY)
    assert engine.loaded.mem.total_charged() == plan.planned_device_bytes()


def test_a_budget_of_n_blobs_loads_more_slots_when_blobs_are_smaller(packs, card):
    engine = Engine.open(packs("mixtral", "mixed"), sim(card(16), expert_cache="6"))
    book, largest = engine.runner.book, engine.loaded.plan.largest_blob
    assert len(engine.runner.slots) > 6 and book.used <= 6 * largest


def test_a_card_filled_between_plan_and_load_shrinks_the_cache_and_says_so(packs, card, monkeypatch):
    import moefit.runtime.loader as loader
    path = card(16)
    real_fill = loader.fill_cache

    def fill_after_a_browser_starts(runner, plan, kind, log):
        free_mib = (runner.mem.snapshot().free_bytes - plan.reserve.total) / L.MIB
        card(16, [(777, "chromium", free_mib - 0.06)])         # leaves room for about 3 blobs
        return real_fill(runner, plan, kind, log)
    monkeypatch.setattr(loader, "fill_cache", fill_after_a_browser_starts)
    said = []
    engine = Engine.open(packs("mixtral", "int8"), sim(path), log=said.append)
    assert 0 < len(engine.runner.slots) < engine.loaded.plan.slots
    assert "the card filled up while the cache loaded" in said[0]
    assert engine.generate(PROMPT, GREEDY)[2] == "length"


def test_a_card_filled_below_the_minimum_is_refused_with_the_ledger(packs, card, monkeypatch):
    import moefit.runtime.loader as loader
    path = card(16)
    real_fill = loader.fill_cache

    def fill_it_all(runner, plan, kind, log):
        card(16, [(777, "chromium", runner.mem.snapshot().free_bytes / L.MIB)])
        return real_fill(runner, plan, kind, log)
    monkeypatch.setattr(loader, "fill_cache", fill_it_all)
    with pytest.raises(RefusedError) as e:
        Engine.open(packs("mixtral", "int8"), sim(path, min_expert_slots=None))
    assert "refused" in str(e.value) and "expert cache" in str(e.value) and "fixes:" in str(e.value)


def test_fill_skips_a_blob_that_does_not_fit_and_keeps_going():
    sizes = {(0, 0): 10, (0, 1): 30, (0, 2): 10}
    assert fill([(0, 0), (0, 1), (0, 2)], sizes, 25) == [(0, 0), (0, 2)]


def test_adaptive_tier_swaps_in_a_hot_expert_for_the_coldest():
    sizes = {(0, e): 100 for e in range(4)}
    book = CacheBook(sizes, 1, 4, 200, SwapPolicy(max_swaps=2))
    book.admit((0, 0))
    book.admit((0, 1))
    for _ in range(10):
        book.record(0, [0, 3], [True, False])
    assert book.swap_round() == [((0, 1), (0, 3))]
    static = CacheBook(sizes, 1, 4, 200, SwapPolicy(max_swaps=0))
    static.admit((0, 0))
    static.record(0, [3], [False])
    assert static.swap_round() == []


def test_adaptive_swaps_during_decoding_keep_the_output(packs, card):
    pack = packs("olmoe", "int8")
    want = Engine.open(pack, ServeConfig(ctx=64)).generate(PROMPT, GREEDY)[1].generated
    engine = Engine.open(pack, sim(card(16), expert_cache="4", swap_period=2, max_swaps=2))
    assert engine.generate(PROMPT, GREEDY)[1].generated == want
    assert engine.runner.book.swaps > 0 and len(engine.runner.slots) == 4


def test_coldest_of_size_is_coldest_filtered_without_the_sort():
    rng = np.random.default_rng(3)
    for trial in range(40):
        sizes = {(l, e): int(rng.choice([100, 200])) for l in range(4) for e in range(6)}
        book = CacheBook(sizes, 4, 6, budget=1 << 30)
        for key in sizes:
            if rng.random() < 0.6:
                book.admit(key)
        book.set_usage(rng.integers(0, 3, size=book.usage.shape))       # ties on purpose
        evicted = [k for k in list(book.resident) if rng.random() < 0.2]
        for key in evicted:
            book.evict(key)
        skip = {k for k in sizes if rng.random() < 0.3}
        for size in (100, 200):
            want = [k for k in book.coldest() if sizes[k] == size and k not in skip]
            assert book.coldest_of_size(size, skip) == want[:1]
            for n in (2, 3, 7, 40):
                assert book.coldest_of_size(size, skip, n) == want[:n]


def test_a_prefetchs_victims_found_once_are_those_it_would_find_one_by_one():
    """Victims (experts/cache.py): the coldest of a size class not kept nor arriving, found once for
    a prefetch's admissions, are what a search before each admission would find, with each victim
    evicted and each admitted expert arriving in between."""
    from moefit.experts.cache import Victims
    rng = np.random.default_rng(7)
    for trial in range(30):
        sizes = {(l, e): int(rng.choice([100, 200])) for l in range(4) for e in range(8)}
        books = [CacheBook(dict(sizes), 4, 8, budget=1 << 30) for _ in range(2)]
        usage = rng.integers(0, 3, size=(4, 8))
        resident = [k for k in sizes if rng.random() < 0.7]
        keep = {k for k in resident if rng.random() < 0.2}
        admits = [k for k in sizes if k not in resident][:5]
        flying = {k: None for k in resident if rng.random() < 0.1}
        arriving = [dict(flying), dict(flying)]
        for book in books:
            for key in resident:
                book.admit(key)
            book.set_usage(usage)
        found = Victims(books[0], keep, arriving[0], len(admits))
        for key in admits:
            once = found.pop(sizes[key])
            one_by_one = (books[1].coldest_of_size(sizes[key], keep | arriving[1].keys()) or [None])[0]
            assert once == one_by_one, (trial, key)
            for book, flying in zip(books, arriving):
                if once is not None:
                    book.evict(once)
                book.admit(key)
                flying[key] = None


def test_shrink_gives_back_the_coldest_first():
    sizes = {(0, e): 100 for e in range(3)}
    book = CacheBook(sizes, 1, 3, 300)
    for e in range(3):
        book.admit((0, e))
    book.set_usage([[5.0, 1.0, 9.0]])
    assert book.shrink_to(150) == [(0, 1), (0, 0)]


def test_profile_command_records_hotness_that_orders_the_fill(packs, tmp_path, card):
    import json
    import shutil
    import subprocess
    import sys
    pack = tmp_path / "pack"
    shutil.copytree(packs("mixtral", "int8"), pack)
    (tmp_path / "prompts.txt").write_text("the lantern burns\na river runs to the sea\n")
    r = subprocess.run([sys.executable, "-m", "moefit", "profile", str(pack), "--prompts", str(tmp_path / "prompts.txt"),
                        "--max-tokens", "8"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    counts = json.loads((pack / "profile.json").read_text())["counts"]
    assert sum(map(sum, counts)) > 0
    engine = Engine.open(pack, sim(card(16), expert_cache="3"))
    keys = [(l, e) for l, row in enumerate(counts) for e in range(len(row))]
    hottest = sorted(keys, key=lambda k: (-counts[k[0]][k[1]], k[1], k[0]))[:3]   # ties: round-robin layers
    assert set(engine.runner.slots) == set(hottest)


def test_dump_routing_writes_every_tokens_experts(packs, tmp_path):
    import json
    import subprocess
    import sys
    out = tmp_path / "routing.jsonl"
    r = subprocess.run([sys.executable, "-m", "moefit", "generate", str(packs("olmoe", "int8")), "--prompt", "the king",
                        "--max-tokens", "4", "--ignore-eos", "--dump-routing", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {row["layer"] for row in rows} == {0, 1, 2}
    assert all(len(row["experts"]) == 2 and len(row["weights"]) == 2 for row in rows)


@pytest.mark.parametrize("quant,tol", [("int8", 0.04), ("int4", 0.25)])
def test_quantised_dense_weights_stay_close_and_the_ledger_still_matches_the_card(quant, tol, packs, card):
    pack = packs("qwen3_moe", "int8")
    exact = Engine.open(pack, ServeConfig(ctx=64)).prefill(PROMPT)[0]
    engine = Engine.open(pack, sim(card(16), dense_quant=quant))
    got = engine.prefill(PROMPT)[0]
    # int8 weights per row (int4: per group of 32) and, in the native kernel, int8 activations per
    # block of 32 (llama.cpp's scheme) on every dense matrix, compounded over the tiny model's layers;
    # int4 keeps ~8 % RMS weight error on Gaussian weights, as the experts' test says.
    assert (got - exact).norm() / exact.norm() < tol
    if quant == "int8":
        assert got.argmax() == exact.argmax()
    else:                        # kept as the kernel reads it where it multiplies int4 in panels (SIMD)
        from moefit import kernels
        assert {w.quant for w in qweights(engine.model)} == ({"int4p"} if kernels.int4_panels() else {"int4"})
    plan = engine.loaded.plan
    assert engine.loaded.mem.charged[L.DENSE] == plan.line(L.DENSE).bytes
    full = Engine.open(pack, sim(card(16))).loaded.plan.line(L.DENSE).bytes
    assert plan.line(L.DENSE).bytes < 0.4 * full           # (int4 keeps o_proj [64, 80] in fp32: 80 % 32 != 0)


def qweights(obj, depth: int = 5):
    """The dense matrices quantised at load (QWeight) reachable from obj."""
    from moefit.models.layers import QWeight
    if isinstance(obj, QWeight):
        yield obj
    elif depth and isinstance(obj, (list, tuple, dict)):
        for item in obj.values() if isinstance(obj, dict) else obj:
            yield from qweights(item, depth - 1)
    elif depth and hasattr(obj, "__dict__") and type(obj).__module__.startswith("moefit.models"):
        for item in vars(obj).values():
            yield from qweights(item, depth - 1)


def test_the_victims_index_follows_every_change_of_use_and_residency():
    """coldest_of_size reads an index that admit, evict, record, swap_round and set_usage keep
    (experts/cache.py): after any mix of them it names what coldest() filtered would, ties
    included; and usage cannot be written around it."""
    rng = np.random.default_rng(11)
    sizes = {(l, e): int(rng.choice([100, 200])) for l in range(3) for e in range(5)}
    book = CacheBook(sizes, 3, 5, budget=1 << 30, policy=SwapPolicy(decay=0.5, max_swaps=0))
    for step in range(300):
        key = list(sizes)[rng.integers(len(sizes))]
        op = rng.integers(5)
        if op == 0 and key not in book.resident:
            book.admit(key)
        elif op == 1 and key in book.resident:
            book.evict(key)
        elif op == 2:
            experts = sorted({int(e) for e in rng.integers(0, 5, size=2)})
            book.record(key[0], experts, [(key[0], e) in book.resident for e in experts])
        elif op == 3:
            book.swap_round()
        elif step % 50 == 0:
            book.set_usage(rng.integers(0, 3, size=book.usage.shape))
        skip = {k for k in sizes if rng.random() < 0.2}
        for size in (100, 200):
            want = [k for k in book.coldest() if sizes[k] == size and k not in skip]
            assert book.coldest_of_size(size, skip, 3) == want[:3], step
    with pytest.raises(ValueError):
        book.usage[0, 0] = 1.0


def test_the_profile_counts_every_routing_whether_held_in_lists_or_added_at_once(monkeypatch):
    """A decode step's routings wait in lists (no numpy on the engine thread's path); a read of
    counts, a prompt's routing or a long run of steps adds them up, and nothing is lost or twice."""
    from moefit.experts import profile as profile_module
    from moefit.experts.profile import Profile
    monkeypatch.setattr(profile_module, "FOLD_AT", 20)
    rng = np.random.default_rng(3)
    p, want = Profile.empty(4, 16), np.zeros((4, 16), dtype=np.int64)
    for step in range(60):
        layer, tokens = int(rng.integers(4)), int(rng.choice([1, 1, 2, 7]))
        rows = rng.integers(0, 16, size=(tokens, 3)).tolist()
        p.record(layer, rows)
        np.add.at(want[layer], np.asarray(rows).reshape(-1), 1)
        if step % 17 == 0:
            assert (p.counts == want).all(), step
        assert len(p._layers) <= 20 + 6
    assert (p.counts == want).all() and not p._layers
    p.counts = np.ones((4, 16), dtype=np.int64)
    p.record(1, [[2, 3]])
    assert p.counts[1, 2] == 2 and p.counts.sum() == 66

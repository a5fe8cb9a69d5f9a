"""Expert-cache policies replayed on routing traces (not a test): static profile placement,
LRU, LFU, moefit's adaptive tier, the adaptive tier with look-ahead prefetch, and Belady's MIN
with bypass (the best any demand cache can do), at budgets of 5, 10, 15, 25 and 50 % of the
experts. Prints hit rates and each policy's ratio to MIN.

Look-ahead: traces made with a cache (a simulated card) carry each token's guess for the layer
(the pack's probe, or the layer's own router, on the residual stream one layer earlier: 2k
experts, most likely first; the first k are the prediction whose recall is printed). Before a
step, up to B experts that are not resident are brought in, in the engine's order
(experts/lookahead.py): the guess's first k, the layer's routing for the previous token, the
guess's other ranks; the first MoE layer (no guess) gets its previous routing. They replace the
coldest slots that neither the step before (the layer computing while the copies run) routed
to, nor the guess's first k, nor the layer's previous routing names. B is the PCIe budget per
layer, in experts (PF_BUDGETS says what PCIe moves).

    .venv/bin/python bench/cache_policy.py [TRACE.jsonl[.gz] ...]
    .venv/bin/python bench/cache_policy.py --make-traces PACK      # dump fresh traces first
    .venv/bin/python bench/cache_policy.py --fixture DIR           # a random fixture's traces instead

The fixture: a random Qwen3-MoE of tests/tiny.py's kind, larger (6 layers of 64 experts, top-8,
routers sharpened as the tests do), packed int8, its look-ahead probe fitted (`moefit profile
--probe`) on 30 other prompts, and run on a generous simulated card with a quarter of its
experts cached, so that its look-ahead predictions are in the traces too.

A trace is what `moefit generate --dump-routing FILE` writes: one JSON line per (token,
layer) with the routed expert ids. The first quarter of each trace is the profiling
period (static placement and the adaptive tier start from it); all policies are scored on
the rest. LRU, LFU and MIN fetch on every miss; static never moves; the adaptive tier
moves a few experts per round, as the engine does.
"""

from __future__ import annotations

import argparse
import gzip
import heapq
import json
import subprocess
import sys
from collections import OrderedDict, defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moefit.experts.cache import CacheBook, SwapPolicy  # noqa: E402

DEFAULT_TRACES = Path(__file__).parent / "traces"
BUDGETS = (0.05, 0.10, 0.15, 0.25, 0.30, 0.50)
# Experts one layer's time lets PCIe bring in: Qwen3-30B-A3B's int4 expert is 2.5 MB, a layer at
# 40 tok/s is 0.52 ms (48 layers), so PCIe 4.0 x16 (~25 GB/s pinned) moves ~5, PCIe 5.0 ~10.
PF_BUDGETS = (1, 2, 4, 8)
PROMPTS = ["Define: lantern", "Define: river", "Define: justice", "Define: harbor", "Define: to wander",
           "Define: bright", "Define: quickly", "Define: orchestra"]
# the fixture's probe is fitted on these, never on PROMPTS
PROBE_WORDS = ("mountain silver anchor echo garden whisper candle forest thunder bridge mirror pebble meadow "
               "compass velvet glacier lantern-fish ember orchard ripple cobalt falcon saddle quarry tundra "
               "beacon marble hollow crimson drift").split()


def read_trace(path: Path) -> tuple[list[list[tuple[int, int]]], list[list[tuple[int, int]] | None]]:
    """(steps, predictions): each step is the (layer, expert) keys one token touched in one
    layer; its prediction the keys foreseen for it (None where the trace has none)."""
    opener = gzip.open if path.suffix == ".gz" else open
    steps, preds = [], []
    with opener(path, "rt") as f:
        for row in map(json.loads, f):
            steps.append([(row["layer"], e) for e in sorted(set(row["experts"]))])
            guess = row.get("predicted")
            preds.append(None if guess is None else [(row["layer"], e) for e in guess])
    return steps, preds


def static(profile_steps, steps, capacity) -> float:
    counts = defaultdict(int)
    for step in profile_steps:
        for key in step:
            counts[key] += 1
    resident = set(sorted(counts, key=lambda k: -counts[k])[:capacity])
    return _score(steps, lambda key: key in resident)


def lru(profile_steps, steps, capacity) -> float:
    return _replay(profile_steps, steps, capacity, "lru")


def _replay(profile_steps, steps, capacity, kind: str) -> float:
    """LRU or LFU with fetch on miss; warmed on the profiling period, scored on the rest."""
    cache: OrderedDict = OrderedDict()
    freq = defaultdict(int)
    hits = total = 0
    for i, step in enumerate(profile_steps + steps):
        scored = i >= len(profile_steps)
        for key in step:
            freq[key] += 1
            hit = key in cache
            if scored:
                hits += hit
                total += 1
            if hit:
                cache.move_to_end(key)
                continue
            if len(cache) >= capacity:
                victim = next(iter(cache)) if kind == "lru" else min(cache, key=lambda k: freq[k])
                del cache[victim]
            cache[key] = True
    return hits / total


def lfu(profile_steps, steps, capacity) -> float:
    return _replay(profile_steps, steps, capacity, "lfu")


def belady(profile_steps, steps, capacity) -> float:
    """MIN with bypass, the offline optimum: on a miss with a full cache, evict the expert
    used furthest in the future, unless the newcomer itself is used even later (then it
    is computed on the host and not admitted, as moefit can do)."""
    accesses = [key for step in steps for key in step]
    nxt, last = [0] * len(accesses), {}
    for i in range(len(accesses) - 1, -1, -1):
        nxt[i] = last.get(accesses[i], 1 << 60)
        last[accesses[i]] = i
    cache, heap, hits = {}, [], 0
    for i, key in enumerate(accesses):
        if key in cache:
            hits += 1
        elif len(cache) >= capacity:
            while cache.get(heap[0][1]) != -heap[0][0]:
                heapq.heappop(heap)                       # stale entries
            if nxt[i] >= -heap[0][0]:
                continue                                  # bypass: the newcomer is needed last
            del cache[heapq.heappop(heap)[1]]
        cache[key] = nxt[i]
        heapq.heappush(heap, (-nxt[i], key))
    return hits / len(accesses)


def adaptive(profile_steps, steps, capacity, layers, experts, preds=None, budget: int = 0) -> float:
    """moefit's tier: profile placement, then swap rounds on decayed usage (CacheBook); with
    preds and a budget, the look-ahead prefetch before each step."""
    counts = defaultdict(int)
    for step in profile_steps:
        for key in step:
            counts[key] += 1
    sizes = {(l, e): 1 for l in range(layers) for e in range(experts)}
    book = CacheBook(sizes, layers, experts, capacity, SwapPolicy(period=1, decay=0.98, max_swaps=2, margin=1.1))
    for key in sorted(sizes, key=lambda k: -counts[k])[:capacity]:
        book.admit(key)
    seeded = np.zeros((layers, experts))
    for key, c in counts.items():
        seeded[key] = c * 0.02
    book.set_usage(seeded)
    hits = total = 0
    per_token = max(1, len({k[0] for s in steps[:50] for k in s}))
    top_k = max(len(s) for s in steps[:50])
    first = min(k[0] for s in steps[:50] for k in s)
    recent = {}                              # layer -> the previous token's routing there
    for i, step in enumerate(steps):
        layer = step[0][0] if step else None
        before = recent.get(layer, [])
        if budget and (preds[i] or layer == first):     # the engine's rule (experts/lookahead.py)
            guess = list(dict.fromkeys((preds[i] or [])[:top_k] + before + (preds[i] or [])[top_k:]))
            prefetch(book, guess, set((preds[i] or [])[:top_k]) | set(before) | set(steps[i - 1] if i else ()), budget)
        if step:
            recent[layer] = step
        resident = [key in book.resident for key in step]
        hits, total = hits + sum(resident), total + len(step)
        if step:
            book.record(step[0][0], [k[1] for k in step], resident)
        if (i + 1) % (per_token * 8) == 0:                    # a round every 8 tokens
            for evict, admit in book.swap_round():
                book.evict(evict)
                book.admit(admit)
    return hits / total


def cold_start(steps, capacity, layers, experts, target: float, window: int = 100) -> tuple[int | None, list]:
    """The engine's adaptive tier (its default swap policy) from a cold start: pack order, no
    profile. Returns the tokens until the hit rate over the last `window` tokens reaches
    `target` (None if never), and that rolling hit rate every 100 tokens."""
    sizes = {(l, e): 1 for l in range(layers) for e in range(experts)}
    policy = SwapPolicy()
    book = CacheBook(sizes, layers, experts, capacity, policy)
    for key in sorted(sizes, key=lambda k: (k[1], k[0]))[:capacity]:       # Profile.hottest_first, no counts
        book.admit(key)
    per_token = max(1, len({k[0] for s in steps[:50] for k in s}))
    hits, seen, curve, reached = [], 0, [], None
    for i, step in enumerate(steps):
        resident = [key in book.resident for key in step]
        book.record(step[0][0], [k[1] for k in step], resident)
        seen += sum(resident)
        if (i + 1) % per_token:
            continue
        hits.append(seen / max(1, sum(len(s) for s in steps[i + 1 - per_token:i + 1])))
        seen = 0
        if len(hits) % policy.period == 0:
            for evict, admit in book.swap_round():
                book.evict(evict)
                book.admit(admit)
        rolling = sum(hits[-window:]) / len(hits[-window:])
        if reached is None and len(hits) >= window and rolling >= target:
            reached = len(hits)
        if len(hits) % 100 == 0:
            curve.append(round(rolling, 3))
    return reached, curve


def prefetch(book: CacheBook, predicted: list, wanted: set, budget: int) -> None:
    """Bring up to budget predicted experts in, evicting the coldest that no prediction wants."""
    missing = [k for k in predicted if k not in book.resident][:budget]
    for key in missing:
        victim = next((v for v in book.coldest() if v not in wanted), None)
        if victim is None:
            return
        book.evict(victim)
        book.admit(key)


def _score(steps, is_hit) -> float:
    hits = sum(is_hit(key) for step in steps for key in step)
    return hits / sum(len(step) for step in steps)


def make_traces(pack: str, out: Path, tokens: int) -> None:
    """Routing of the demo prompts, generated on the demo's simulated card (so that the
    look-ahead runs and its predictions are in the trace)."""
    from moefit.demo import CARD, SIM_FLAGS
    dump_traces(pack, out, tokens, ["--chat", "--device", f"sim:{CARD}", *SIM_FLAGS])


def dump_traces(pack, out: Path, tokens: int, flags: list[str]) -> None:
    """One gzipped trace per prompt: `moefit generate --dump-routing` with these flags, each
    (token, layer) row cut to its layer, experts and predictions."""
    out.mkdir(parents=True, exist_ok=True)
    for i, prompt in enumerate(PROMPTS):
        raw = out / f"trace-{i}.jsonl"
        subprocess.run([sys.executable, "-m", "moefit", "generate", str(pack), "--prompt", prompt,
                        "--max-tokens", str(tokens), "--temperature", "0.8", "--seed", str(i), "--ignore-eos",
                        "--dump-routing", str(raw), "--settle-s", "0", "--state-dir", str(out / "state"), *flags],
                       check=True, capture_output=True)
        with open(raw) as f, gzip.open(str(raw) + ".gz", "wt") as g:
            for line in f:
                row = json.loads(line)
                g.write(json.dumps({k: row[k] for k in ("layer", "experts", "predicted") if k in row}) + "\n")
        raw.unlink()


def make_fixture_traces(out: Path, tokens: int) -> None:
    """The fixture (see the module's docstring): checkpoint, pack, card, and its traces."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from tiny import build_checkpoint
    from moefit.memory.simcard import write_card
    from moefit.pack.convert import convert
    out.mkdir(parents=True, exist_ok=True)
    hf = build_checkpoint("qwen3_moe", out / "hf", num_experts=64, num_experts_per_tok=8, num_hidden_layers=6,
                          mlp_only_layers=[], hidden_size=128, moe_intermediate_size=128)
    pack = out / "pack"
    if not (pack / "moefit-pack.json").exists():
        convert(hf, pack, "int8", progress=False)
    if "probe" not in json.loads((pack / "moefit-pack.json").read_text()):
        prompts = out / "probe-prompts.txt"
        prompts.write_text("".join(f"Define: {w}\n" for w in PROBE_WORDS))
        subprocess.run([sys.executable, "-m", "moefit", "profile", str(pack), "--prompts", str(prompts),
                        "--max-tokens", "200", "--probe"], check=True)
    card = out / "card.json"
    write_card(card, "fixture card (simulated)", 4096, [])
    dump_traces(pack, out, tokens, ["--device", f"sim:{card}", "--expert-cache", str(6 * 64 // 4),
                                    "--ctx", str(tokens + 64)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="*")
    ap.add_argument("--make-traces", metavar="PACK")
    ap.add_argument("--fixture", metavar="DIR", help="make and replay a random fixture's traces in DIR")
    ap.add_argument("--tokens", type=int, default=1500)
    args = ap.parse_args()
    if args.make_traces:
        make_traces(args.make_traces, DEFAULT_TRACES, args.tokens)
    if args.fixture:
        make_fixture_traces(Path(args.fixture), args.tokens)
        args.traces = sorted(str(p) for p in Path(args.fixture).glob("trace-*.jsonl.gz"))
    paths = [Path(p) for p in args.traces] or sorted(DEFAULT_TRACES.glob("*.jsonl*"))
    read = [read_trace(p) for p in paths]
    steps = [s for st, _ in read for s in st]
    preds = [g for _, pr in read for g in pr]
    layers = 1 + max(k[0] for s in steps for k in s)
    moe_layers = len({k[0] for s in steps for k in s})
    experts = 1 + max(k[1] for s in steps for k in s)
    cut = len(steps) // 4
    profile_steps, scored, scored_preds = steps[:cut], steps[cut:], preds[cut:]
    have = any(p is not None for p in scored_preds)
    recall = _recall(scored, scored_preds) if have else None
    print(f"# {len(paths)} traces, {len(steps)} (token, layer) steps, {moe_layers} MoE layers x {experts} experts; "
          f"first quarter profiles, the rest is scored; prediction recall "
          f"{'-' if recall is None else f'{recall:.3f}'}; +pfB = adaptive with look-ahead, B experts a layer")
    names = ("static", "LRU", "LFU", "adaptive") + tuple(f"+pf{b}" for b in PF_BUDGETS if have)
    print(f"{'budget':>8} " + " ".join(f"{n:>8}" for n in names) + f" {'MIN':>8}   ratio to MIN")
    for share in BUDGETS:
        cap = max(1, int(share * moe_layers * experts))
        r = {"static": static(profile_steps, scored, cap), "LRU": lru(profile_steps, scored, cap),
             "LFU": lfu(profile_steps, scored, cap), "adaptive": adaptive(profile_steps, scored, cap, layers, experts)}
        for b in PF_BUDGETS if have else ():
            r[f"+pf{b}"] = adaptive(profile_steps, scored, cap, layers, experts, scored_preds, b)
        r["MIN"] = belady(profile_steps, scored, cap)
        ratios = " ".join(f"{r[k] / r['MIN']:.2f}" if r["MIN"] else "-" for k in names)
        print(f"{share:>7.0%} " + " ".join(f"{r[n]:>8.3f}" for n in names) + f" {r['MIN']:>8.3f}   {ratios}")
    cap = int(0.15 * moe_layers * experts)
    warm = adaptive(profile_steps, scored, cap, layers, experts)
    first = read[0][0]
    reached, curve = cold_start(first, cap, layers, experts, 0.9 * warm)
    print(f"# cold start at 15 %, one trace ({len(first) // moe_layers} tokens), the engine's swap policy: the hit rate "
          f"over 100 tokens reaches 90 % of the profiled adaptive's {warm:.3f} after "
          f"{reached if reached is not None else 'never (within the trace)'} tokens; every 100 tokens: {curve}")


def _recall(steps, preds) -> float:
    """Of the routed experts, the share among each guess's first k (a guess ranks more)."""
    hit = sum(len(set(s) & set(p[:len(s)])) for s, p in zip(steps, preds) if p is not None)
    return hit / sum(len(s) for s, p in zip(steps, preds) if p is not None)


if __name__ == "__main__":
    main()

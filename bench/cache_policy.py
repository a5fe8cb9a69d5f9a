"""Expert-cache policies replayed on routing traces (not a test): static profile placement,
LRU, LFU, moefit's adaptive tier, and Belady's MIN with bypass (the offline optimum), at budgets of
5, 10, 15, 25 and 50 % of the experts. Prints hit rates and each policy's ratio to MIN.

    .venv/bin/python bench/cache_policy.py [TRACE.jsonl[.gz] ...]
    .venv/bin/python bench/cache_policy.py --make-traces PACK      # dump fresh traces first

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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moefit.experts.cache import CacheBook, SwapPolicy  # noqa: E402

DEFAULT_TRACES = Path(__file__).parent / "traces"
BUDGETS = (0.05, 0.10, 0.15, 0.25, 0.50)
PROMPTS = ["Define: lantern", "Define: river", "Define: justice", "Define: harbor", "Define: to wander",
           "Define: bright", "Define: quickly", "Define: orchestra"]


def read_trace(path: Path) -> list[list[tuple[int, int]]]:
    """Steps: each step is the (layer, expert) keys one token touched in one layer."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return [[(row["layer"], e) for e in sorted(set(row["experts"]))] for row in map(json.loads, f)]


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


def adaptive(profile_steps, steps, capacity, layers, experts) -> float:
    """moefit's tier: profile placement, then swap rounds on decayed usage (CacheBook)."""
    counts = defaultdict(int)
    for step in profile_steps:
        for key in step:
            counts[key] += 1
    sizes = {(l, e): 1 for l in range(layers) for e in range(experts)}
    book = CacheBook(sizes, layers, experts, capacity, SwapPolicy(period=1, decay=0.98, max_swaps=2, margin=1.1))
    for key in sorted(sizes, key=lambda k: -counts[k])[:capacity]:
        book.admit(key)
    for key, c in counts.items():
        book.usage[key] = c * 0.02
    hits = total = 0
    per_token = max(1, len({k[0] for s in steps[:50] for k in s}))
    for i, step in enumerate(steps):
        resident = [key in book.resident for key in step]
        hits, total = hits + sum(resident), total + len(step)
        if step:
            book.record(step[0][0], [k[1] for k in step], resident)
        if (i + 1) % (per_token * 8) == 0:                    # a round every 8 tokens
            for evict, admit in book.swap_round():
                book.evict(evict)
                book.admit(admit)
    return hits / total


def _score(steps, is_hit) -> float:
    hits = sum(is_hit(key) for step in steps for key in step)
    return hits / sum(len(step) for step in steps)


def make_traces(pack: str, out: Path, tokens: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for i, prompt in enumerate(PROMPTS):
        raw = out / f"trace-{i}.jsonl"
        subprocess.run([sys.executable, "-m", "moefit", "generate", pack, "--chat", "--prompt", prompt,
                        "--max-tokens", str(tokens), "--temperature", "0.8", "--seed", str(i), "--ignore-eos",
                        "--dump-routing", str(raw)], check=True, capture_output=True)
        with open(raw) as f, gzip.open(str(raw) + ".gz", "wt") as g:
            for line in f:
                row = json.loads(line)
                g.write(json.dumps({"layer": row["layer"], "experts": row["experts"]}) + "\n")
        raw.unlink()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="*")
    ap.add_argument("--make-traces", metavar="PACK")
    ap.add_argument("--tokens", type=int, default=1500)
    args = ap.parse_args()
    if args.make_traces:
        make_traces(args.make_traces, DEFAULT_TRACES, args.tokens)
    paths = [Path(p) for p in args.traces] or sorted(DEFAULT_TRACES.glob("*.jsonl*"))
    steps = [s for p in paths for s in read_trace(p)]
    layers = 1 + max(k[0] for s in steps for k in s)
    moe_layers = len({k[0] for s in steps for k in s})
    experts = 1 + max(k[1] for s in steps for k in s)
    cut = len(steps) // 4
    profile_steps, scored = steps[:cut], steps[cut:]
    print(f"# {len(paths)} traces, {len(steps)} (token, layer) steps, {moe_layers} MoE layers x {experts} experts; "
          f"first quarter profiles, the rest is scored")
    print(f"{'budget':>8} {'static':>8} {'LRU':>8} {'LFU':>8} {'adaptive':>9} {'MIN':>8}   ratio to MIN (static LRU LFU adaptive)")
    for share in BUDGETS:
        cap = max(1, int(share * moe_layers * experts))
        r = {"static": static(profile_steps, scored, cap), "LRU": lru(profile_steps, scored, cap),
             "LFU": lfu(profile_steps, scored, cap), "adaptive": adaptive(profile_steps, scored, cap, layers, experts),
             "MIN": belady(profile_steps, scored, cap)}
        ratios = " ".join(f"{r[k] / r['MIN']:.2f}" if r["MIN"] else "-" for k in ("static", "LRU", "LFU", "adaptive"))
        print(f"{share:>7.0%} {r['static']:>8.3f} {r['LRU']:>8.3f} {r['LFU']:>8.3f} {r['adaptive']:>9.3f} "
              f"{r['MIN']:>8.3f}   {ratios}")


if __name__ == "__main__":
    main()

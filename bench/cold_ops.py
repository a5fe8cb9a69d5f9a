"""The runner's bookkeeping steps as a GPU would wait on them: each timed right after 32 MB have
been streamed through the caches (what the host's expert call leaves behind), and warm.

    python bench/cold_ops.py

The steps of a decode step's layer call (and a 16-token verify window's subset) on a Qwen3-30B-A3B
shape (48 layers, 128 experts, top-8; a quarter of the experts resident for the victims' search).
Prints us a call, cold and warm, for each.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moefit.experts.cache import CacheBook  # noqa: E402
from moefit.experts.groups import Groups  # noqa: E402
from moefit.experts.profile import Profile  # noqa: E402

LAYERS, EXPERTS, K = 48, 128, 8
STREAM = np.ones(8 << 20, dtype=np.float32)           # 32 MB


def timed(f, cold: bool, n: int) -> float:
    total = 0
    for _ in range(n):
        if cold:
            STREAM.sum()
        t = time.perf_counter_ns()
        f()
        total += time.perf_counter_ns() - t
    return total / n / 1e3


def steps() -> dict:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randperm(EXPERTS, generator=gen)[:K][None]
    weights = torch.rand(1, K, generator=gen)
    window = torch.stack([torch.randperm(EXPERTS, generator=gen)[:K] for _ in range(16)])
    decode, verify = Groups.of(ids, weights), Groups.of(window, torch.rand(16, K, generator=gen))
    profile = Profile.empty(LAYERS, EXPERTS)
    sizes = {(layer, e): 100 for layer in range(LAYERS) for e in range(EXPERTS)}
    book = CacheBook(sizes, LAYERS, EXPERTS, 1 << 40)
    random.seed(0)
    for key in random.sample(list(sizes), len(sizes) // 4):
        book.admit(key)
    book.set_usage(np.random.default_rng(0).random((LAYERS, EXPERTS)))
    keep = {(3, e) for e in range(16)} | {(4, e) for e in range(8)}
    return {
        "routing to lists": lambda: ids.tolist(),
        "Groups.of, a decode step": lambda: Groups.of(ids, weights, ids.tolist()),
        "Profile.record, a decode step": lambda: profile.record(3, ids.tolist()),
        "Groups.subset, half of a decode step": lambda: decode.subset([i % 2 == 0 for i in range(K)]),
        "Groups.subset, a third of 16 tokens'": lambda: verify.subset([i % 3 == 0 for i in range(len(verify.experts))]),
        "victims' search, 2 of a quarter": lambda: book.coldest_of_size(100, keep, 2),
    }


def main() -> None:
    print(f"us a call, {torch.get_num_threads()} torch threads, after 32 MB streamed (cold) / in a loop (warm)")
    for name, f in steps().items():
        print(f"  {name:40s} {timed(f, True, 300):7.1f} {timed(f, False, 3000):7.1f}")


if __name__ == "__main__":
    main()

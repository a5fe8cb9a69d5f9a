"""A decode step's MoE block on a Qwen3.5/3.6-shaped pack: the wall time of the family's `mlp`
(router, shared expert, routed experts, the gate), medians over every decode layer call; --tree
runs another checkout's moefit on the same pack (an A/B: alternate two trees, a process each).
Not a test.

    .venv/bin/python bench/mlp_time.py PACK [--tree DIR] [--repeats 3] [--threads 2]

Prompt 128 random ids, 64 new tokens at the routing-spread temperature, dense int4, --device cpu.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("pack")
    ap.add_argument("--tree", default=str(Path(__file__).resolve().parent.parent))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    sys.path.insert(0, a.tree)
    import torch
    from moefit.config import ServeConfig
    from moefit.models import qwen3_5_moe
    from moefit.runtime.engine import Engine
    from moefit.runtime.sampler import SamplingParams

    engine = Engine.open(Path(a.pack), ServeConfig(ctx=256, dense_quant="int4", threads=a.threads))
    prompt = torch.randint(engine.pack.model.vocab_size, (128,), generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(max_tokens=64, ignore_eos=True, temperature=2.0, top_k=0, top_p=1.0)
    spent, mlp = [], qwen3_5_moe.Qwen3_5Moe.mlp

    def timed(self, i, layer, x, *args, **kw):
        t0 = time.perf_counter()
        out = mlp(self, i, layer, x, *args, **kw)
        if x.shape[0] == 1:
            spent.append(time.perf_counter() - t0)
        return out
    qwen3_5_moe.Qwen3_5Moe.mlp = timed
    for _ in range(a.repeats):
        engine.kv_tokens, spent[:] = [], []
        stats = engine.generate(prompt, params)[1]
        print(f"{a.tree}: decode {stats.decode_tokens_per_s:.1f} tok/s; mlp {1e6 * statistics.median(spent):.0f} us "
              f"a decode layer (median of {len(spent)})")


if __name__ == "__main__":
    main()

"""How long a decode step's MoE layer keeps the kernel pool idle before its host call is posted:
the engine thread's time from ExpertRunner.run's start to the native call's post (moe_post or
step_post), and run's whole time, medians over every decode layer call. Not a test.

    .venv/bin/python bench/post_latency.py PACK [--tree DIR] [--repeats 3] [--threads 2]

--tree runs another checkout's moefit (an A/B: alternate two trees, a process each), on the same
pack. Prompt 128 random ids, 64 new tokens at the routing-spread temperature, dense int4.
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
    from moefit import kernels
    from moefit.config import ServeConfig
    from moefit.experts import runner
    from moefit.runtime.engine import Engine
    from moefit.runtime.sampler import SamplingParams

    engine = Engine.open(Path(a.pack), ServeConfig(ctx=256, dense_quant="int4", threads=a.threads))
    prompt = torch.randint(engine.pack.model.vocab_size, (128,), generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(max_tokens=64, ignore_eos=True, temperature=2.0, top_k=0, top_p=1.0)
    posted_at, before, whole = {}, [], []

    def stamped(post):
        def call(*args, **kw):
            out = post(*args, **kw)
            posted_at["t"] = time.perf_counter()
            return out
        return call
    for name in ("moe_post", "step_post"):
        if hasattr(kernels, name):
            setattr(kernels, name, stamped(getattr(kernels, name)))
    run = runner.ExpertRunner.run

    def timed_run(self, layer, x, *args):
        t0 = time.perf_counter()
        posted_at.clear()
        out = run(self, layer, x, *args)
        if x.shape[0] == 1 and posted_at:
            before.append(posted_at["t"] - t0)
            whole.append(time.perf_counter() - t0)
        return out
    runner.ExpertRunner.run = timed_run
    for _ in range(a.repeats):
        engine.kv_tokens, before[:], whole[:] = [], [], []
        stats = engine.generate(prompt, params)[1]
        print(f"{a.tree}: decode {stats.decode_tokens_per_s:.1f} tok/s; run() to posted "
              f"{1e6 * statistics.median(before):.0f} us, run() {1e6 * statistics.median(whole):.0f} us "
              f"(medians of {len(before)} layer calls)")


if __name__ == "__main__":
    main()

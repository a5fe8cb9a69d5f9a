"""A decode step's MoE layer, timed in place, medians over every decode layer call. Not a test.

    .venv/bin/python bench/step_timing.py PACK --part post|mlp [--tree DIR] [--repeats 3] [--threads 2]

--part post: how long the layer keeps the kernel pool idle before its host call is posted, the
             engine thread's time from ExpertRunner.run's start to the post (moe_post or step_post),
             and run's whole time;
--part mlp:  the wall time of a Qwen3.5/3.6-shaped pack's MoE block (`mlp`: the router, the shared
             expert, the routed experts, the gate).
--tree runs another checkout's moefit on the same pack (an A/B: alternate two trees, a process
each). Prompt 128 random ids, 64 new tokens at the routing-spread temperature, dense int4, --device cpu.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path


def timed_post(spent: dict) -> None:
    """ExpertRunner.run timed, with the moment its host call was posted."""
    from moefit import kernels
    from moefit.experts import runner
    posted_at = {}

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
            spent.setdefault("run() to posted", []).append(posted_at["t"] - t0)
            spent.setdefault("run()", []).append(time.perf_counter() - t0)
        return out
    runner.ExpertRunner.run = timed_run


def timed_mlp(spent: dict) -> None:
    """Qwen3_5Moe.mlp timed."""
    from moefit.models import qwen3_5_moe
    mlp = qwen3_5_moe.Qwen3_5Moe.mlp

    def timed(self, i, layer, x, *args, **kw):
        t0 = time.perf_counter()
        out = mlp(self, i, layer, x, *args, **kw)
        if x.shape[0] == 1:
            spent.setdefault("mlp", []).append(time.perf_counter() - t0)
        return out
    qwen3_5_moe.Qwen3_5Moe.mlp = timed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("pack")
    ap.add_argument("--part", choices=("post", "mlp"), required=True)
    ap.add_argument("--tree", default=str(Path(__file__).resolve().parent.parent))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    sys.path.insert(0, a.tree)
    import torch
    from moefit.config import ServeConfig
    from moefit.runtime.engine import Engine
    from moefit.runtime.sampler import SamplingParams

    engine = Engine.open(Path(a.pack), ServeConfig(ctx=256, dense_quant="int4", threads=a.threads))
    prompt = torch.randint(engine.pack.model.vocab_size, (128,), generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(max_tokens=64, ignore_eos=True, temperature=2.0, top_k=0, top_p=1.0)
    spent: dict[str, list[float]] = {}
    (timed_post if a.part == "post" else timed_mlp)(spent)
    for _ in range(a.repeats):
        engine.kv_tokens = []
        spent.clear()
        stats = engine.generate(prompt, params)[1]
        parts = ", ".join(f"{k} {1e6 * statistics.median(v):.0f} us" for k, v in spent.items())
        print(f"{a.tree}: decode {stats.decode_tokens_per_s:.1f} tok/s; {parts} a decode layer call "
              f"(medians of {len(next(iter(spent.values()), []))})")


if __name__ == "__main__":
    main()

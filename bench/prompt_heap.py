"""Prompts with moefit's heap settings and with glibc's defaults (moefit/host_heap.py), alternated,
each run a process of its own: prefill tokens a second, page faults a prompt and resident MiB after
it. Not a test.

    .venv/bin/python bench/prompt_heap.py PACK [--prompt 512] [--runs 3] [--pairs 3] [--threads 2]

Each process opens PACK with --dense-quant int4, warms up on 16 tokens, then prefills the same
random prompt --runs times (the KV emptied between them; 1 token generated) and prints each run.
The native layer call keeps its scratch either way (kernels/scratch.h).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_prompts(pack: str, prompt: int, runs: int, threads: int) -> None:
    """In this process: one JSON line a prompt."""
    sys.path.insert(0, str(ROOT))
    import moefit
    import torch
    from moefit.config import ServeConfig
    from moefit.runtime.engine import Engine
    from moefit.runtime.sampler import SamplingParams
    engine = Engine.open(Path(pack), ServeConfig(ctx=prompt + 64, dense_quant="int4", threads=threads))
    ids = torch.randint(0, engine.pack.model.vocab_size, (prompt,), generator=torch.Generator().manual_seed(2)).tolist()
    engine.generate(ids[:16], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    for _ in range(runs):
        engine.kv_tokens = []
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        _, stats, _ = engine.generate(ids, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        resident = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20
        print(json.dumps({"heap": "kept" if moefit.HEAP_KEPT else "glibc",
                          "prefill_tok_s": round(stats.prefill_tokens_per_s, 1),
                          "page_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults,
                          "resident_mib": resident}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pack")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        run_prompts(args.pack, args.prompt, args.runs, args.threads)
        return
    print(f"# bench/prompt_heap.py {Path(args.pack).name}: prompt {args.prompt}, {args.threads} threads, dense int4")
    for _ in range(args.pairs):
        for heap in ("glibc", "kept"):
            env = {k: v for k, v in os.environ.items() if k != "MOEFIT_HEAP"}
            env |= {"MOEFIT_HEAP": "default"} if heap == "glibc" else {}
            child = [sys.executable, __file__, args.pack, "--prompt", str(args.prompt), "--runs", str(args.runs),
                     "--threads", str(args.threads), "--child"]
            out = subprocess.run(child, env=env, capture_output=True, text=True, check=True)
            print("\n".join(out.stdout.strip().splitlines()[-args.runs:]), flush=True)


if __name__ == "__main__":
    main()

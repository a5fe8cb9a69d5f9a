"""The engine thread's share of the expert runner on a simulated card: cProfile over one
request's decode, after two warm ones, of a Qwen3-30B-A3B-shaped int4 pack (bench/synthetic_pack.py)
at a share of its experts cached. What the runner costs the engine thread besides the host's
expert call is what a GPU would wait on every layer.

    python bench/runner_profile.py --layers 4 --share 0.25 --tokens 48

Prints tok/s, the hit rate and cProfile's top functions by own time and the runner's callees.
With --timed, no profiler: each of the runner's steps timed per layer call (wall and the engine
thread's CPU), and what the engine thread spends besides waiting for the host's expert call and
for the worker's copies (what a GPU would wait on every layer). The call is posted before the
layer's bookkeeping (`_account`) and joined after it (experts/host_side.py): "native call
waited" is what is left of it by then.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import pstats
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.synthetic_pack import build_pack  # noqa: E402
from moefit.config import ServeConfig  # noqa: E402
from moefit.memory.simcard import write_card  # noqa: E402
from moefit.pack.reader import Pack  # noqa: E402
from moefit.runtime.engine import Engine  # noqa: E402
from moefit.runtime.sampler import SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--share", type=float, default=0.25)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--dir", default=str(Path(tempfile.gettempdir()) / "moefit-runner-profile"))
    ap.add_argument("--timed", action="store_true", help="time the runner's steps instead of profiling")
    a = ap.parse_args()
    root = Path(a.dir)
    pack = root / f"q30-{a.layers}.pack"
    if not (pack / "moefit-pack.json").exists():
        build_pack(ROOT / "configs" / "qwen3-30b-a3b.json", pack, "int4", layers=a.layers, distinct=16)
    write_card(root / "card.json", "simulated 12 GiB", 12288, [], 0)
    total = len(Pack.open(pack, checksums=False).blobs)
    e = Engine.open(pack, ServeConfig(device=f"sim:{root / 'card.json'}", ctx=2048, prefill_chunk=128,
                                      expert_cache=str(int(total * a.share)), vram_reserve_mib=64,
                                      low_headroom_mib=0))
    params = SamplingParams(max_tokens=a.tokens, temperature=1.0, seed=1, ignore_eos=True)
    e.generate(list(range(100, 164)), params)
    e.generate(list(range(200, 264)), params)
    if a.timed:
        timed(e, params, a)
        return
    prof = cProfile.Profile()
    prof.enable()
    e.generate(list(range(300, 364)), params)
    prof.disable()
    print(f"{a.layers} layers, {a.share:.0%} cached: {e.last.decode_tokens_per_s:.2f} tok/s (profiled), "
          f"hit rate {e.runner.book.hit_rate():.3f}")
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumtime").print_callees(r"\(run\)|\(prefetch\)|\(_load_async\)|\(_make_room\)|\(_arrived\)|\(landed\)")
    print(buf.getvalue())


TIMED = ("run", "_account", "prefetch", "_make_room", "_send", "_arrived", "_placed", "_pointers", "catch_up")


def timed(e: Engine, params: SamplingParams, a) -> None:
    """One request with each of TIMED (the runner's), the native call and the worker's waits timed."""
    from moefit import kernels
    from moefit.experts import runner as runner_module, stager
    spent: dict[str, list[int]] = {}

    def wrap(owner, name: str, label: str) -> None:
        f = getattr(owner, name)

        @functools.wraps(f)
        def timed_call(*args, **kw):
            wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
            try:
                return f(*args, **kw)
            finally:
                got = spent.setdefault(label, [0, 0, 0])
                got[0] += time.perf_counter_ns() - wall
                got[1] += time.thread_time_ns() - cpu
                got[2] += 1
        setattr(owner, name, timed_call)
    for name in TIMED:
        wrap(runner_module.ExpertRunner, name, name)
    wrap(kernels, "moe_post", "native call posted")
    wrap(kernels, "step_post", "step call posted")          # a decode step's, from its routing
    wrap(kernels.NativeCall, "result", "native call waited")
    wrap(stager.Stager, "landed", "worker waits (landed)")
    e.generate(list(range(300, 364)), params)
    calls = spent["run"][2]
    print(f"{a.layers} layers, {a.share:.0%} cached: {e.last.decode_tokens_per_s:.2f} tok/s, hit rate "
          f"{e.runner.book.hit_rate():.3f}, {calls} layer calls; us a layer call (wall / engine-thread CPU, calls):")
    for label, (wall, cpu, n) in spent.items():
        print(f"  {label:24s} {wall / calls / 1e3:8.1f} {cpu / calls / 1e3:8.1f}  {n / calls:5.2f}")
    outside = [spent["run"][i] - spent["native call waited"][i] - spent.get("worker waits (landed)", [0, 0])[i]
               for i in (0, 1)]
    print(f"  {'besides the waits':24s} {outside[0] / calls / 1e3:8.1f} {outside[1] / calls / 1e3:8.1f}")


if __name__ == "__main__":
    main()

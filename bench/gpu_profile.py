"""Where a decode token's time goes on the device: the Qwen3-30B-A3B-shaped int4 pack of
bench/gpu_check.py's decode check, at a few cache shares, under cProfile (the host's Python
and waits) and torch.profiler (the device's kernels and the launches that feed them).

    python bench/gpu_profile.py --shares 0.25,1.0 --tokens 16 --out DIR [--graphs on]

Writes DIR/profile-<share>.txt per share: tok/s unprofiled, cProfile's top functions by own
time and by cumulative time, and torch.profiler's top operators by device time and by host time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.synthetic_pack import build_pack  # noqa: E402
from moefit.config import ServeConfig  # noqa: E402
from moefit.pack.reader import Pack  # noqa: E402
from moefit.runtime.engine import Engine  # noqa: E402
from moefit.runtime.sampler import SamplingParams  # noqa: E402


def profile_share(pack: Path, device: str, share: float, tokens: int, graphs: str = "off") -> str:
    total = len(Pack.open(pack, checksums=False).blobs)
    e = Engine.open(pack, ServeConfig(device=device, ctx=2048, prefill_chunk=128, expert_cache=str(int(share * total)),
                                      decode_graphs=graphs))
    params = SamplingParams(max_tokens=tokens, temperature=1.0, seed=2, ignore_eos=True)
    # 64 warm tokens first, as gpu_decode measures: every host expert's first use (its panel copy)
    # and the kernels' compiles fall in them, so the profile is the steady state's
    e.generate(list(range(100, 164)), SamplingParams(max_tokens=64, temperature=1.0, seed=1, ignore_eos=True))
    e.generate(list(range(200, 264)), params)
    lines = [f"share {share}: {len(e.runner.slots)} slots, {e.last.decode_tokens_per_s:.2f} tok/s unprofiled, "
             f"hit rate {e.runner.book.hit_rate():.3f}, handoffs {e.runner.handoffs}, "
             f"decode graphs {e.decode_graphs_json()}"]
    prof = cProfile.Profile()
    prof.enable()
    e.generate(list(range(300, 364)), params)
    prof.disable()
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(30)
        lines.append(buf.getvalue()[-6000:])
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])) as p:
        e.generate(list(range(400, 464)), params)
    averages = p.key_averages()
    for key in (("self_device_time_total" if device.startswith("cuda") else "self_cpu_time_total"),
                "self_cpu_time_total"):
        lines.append(averages.table(sort_by=key, row_limit=25, max_name_column_width=60))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shares", default="0.25,1.0")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--pack", help="an existing pack (default: build the 30B-shaped one)")
    ap.add_argument("--out", default=".")
    ap.add_argument("--graphs", default="off", choices=("off", "on"), help="--decode-graphs")
    args = ap.parse_args()
    t = time.time()
    pack = Path(args.pack) if args.pack else build_pack(ROOT / "configs" / "qwen3-30b-a3b.json",
                                                        Path(tempfile.mkdtemp()) / "q30.pack", "int4",
                                                        layers=args.layers, distinct=16)
    print(f"pack ready in {time.time() - t:.0f} s", flush=True)
    for share in (float(s) for s in args.shares.split(",")):
        text = profile_share(pack, args.device, share, args.tokens, args.graphs)
        Path(args.out, f"profile-{share}{'-graphs' if args.graphs == 'on' else ''}.txt").write_text(text)
        print(text[:3000], flush=True)


if __name__ == "__main__":
    main()

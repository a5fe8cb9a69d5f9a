"""Speculative rejection on a recurrent (Gated DeltaNet) model: what going back costs, three ways.

    .venv/bin/python bench/rollback.py [--layers 4] [--window 4]

A verify window runs the last token and k drafts through the model in one forward; when the
target rejects draft j, the DeltaNet layers have already consumed the rejected tokens, and a
recurrence cannot be cut. Three ways back:
  reforward   snapshot at the window's start, then the kept tokens run through the whole model
              again (attention, MoE experts, lm_head): the first round's way
  replay      snapshot at the window's start, and each DeltaNet layer runs only its own
              forward over the kept tokens' inputs (had it kept them)
  checkpoint  the state after every position of the window but the last is saved (k copies of
              each layer's state matrix) while the recurrent form runs instead of the chunked
              one, and a rejection is one copy back: moefit's way (runtime/state.py)
A Qwen3.6-35B-A3B-shaped pack (its first --layers layers: 3 DeltaNet + 1 attention per 4),
random int4 weights, on this machine's host. Not a test.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.synthetic_pack import build_pack  # noqa: E402
from moefit import kernels  # noqa: E402
from moefit.config import ServeConfig  # noqa: E402
from moefit.runtime.engine import Engine  # noqa: E402


def best(fn, n: int = 7, setup=None) -> float:
    """The fastest of n timed calls of fn, each after an untimed setup()."""
    times = []
    for _ in range(n):
        if setup is not None:
            setup()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--window", type=int, default=4, help="drafts per window (k)")
    ap.add_argument("--pack", help="an existing pack (default: build one in a temporary folder)")
    ap.add_argument("--dense-quant", default="int8", help="the dense matrices in the host kernel (off: torch fp32)")
    args = ap.parse_args()
    pack = Path(args.pack) if args.pack else build_pack(ROOT / "configs" / "qwen3.6-35b-a3b.json",
                                                        Path(tempfile.mkdtemp()) / "q36.pack", "int4",
                                                        layers=args.layers, distinct=16)
    engine = Engine.open(pack, ServeConfig(ctx=1024, dense_quant=args.dense_quant))
    model, kv, k = engine.model, engine.loaded.kv, args.window
    prompt = list(range(100, 164))
    engine.prefill(prompt)
    pos = len(prompt)
    window = [7] + list(range(200, 200 + k))
    linear = [i for i, layer in enumerate(model.layers) if "linear" in layer]
    rows = {}
    plain_verify = best(lambda: engine.forward(window, pos))

    def checkpointed_verify():
        kv.checkpoint(True)
        try:
            engine.forward(window, pos)
        finally:
            kv.checkpoint(False)
    verify = best(checkpointed_verify)
    x = torch.randn(k + 1, model.cfg.hidden_size)
    for kept in range(1, k + 1):
        rows[kept] = {
            "reforward_ms": 1e3 * best(lambda: engine.forward(window[:kept], pos),     # begin() restores the snapshot
                                       setup=lambda: engine.forward(window, pos)),
            "replay_ms": 1e3 * best(lambda: [model.delta_net(i, model.layers[i], x[:kept], pos, kv) for i in linear],
                                    setup=lambda: engine.forward(window, pos)),
            "keep_ms": 1e3 * best(lambda: kv.keep(kept), setup=checkpointed_verify)}
    state = kv.layers[linear[0]]
    state_mib = state.s.numel() * 4 / 2**20
    print(f"# bench/rollback.py: Qwen3.6-35B-A3B shape, first {args.layers} layers ({len(linear)} DeltaNet), "
          f"int4 experts, dense {args.dense_quant}, window of {k} drafts, fp32 activations, "
          f"{kernels.default_threads()} threads, host")
    print(f"verify forward of {k + 1} tokens: {1e3 * plain_verify:.1f} ms; with checkpoints (recurrent form, "
          f"{k} copies of {state_mib:.2f} MiB per DeltaNet layer): {1e3 * verify:.1f} ms")
    print("kept  reforward ms  replay ms  checkpoint ms   (extra time after a rejection)")
    for kept, r in rows.items():
        print(f"{kept:>4}  {r['reforward_ms']:>12.2f}  {r['replay_ms']:>9.2f}  {r['keep_ms']:>13.2f}")
    print(f"checkpoints hold {k * state_mib * len(linear):.1f} MiB during a window ({k * state_mib * 30:.0f} MiB "
          f"for Qwen3.6's 30 DeltaNet layers); the window's forward changes by {1e3 * (verify - plain_verify):+.1f} ms")


if __name__ == "__main__":
    main()

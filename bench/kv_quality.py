"""What KV quantisation costs in accuracy (not a test): teacher-forced next-token logits of
the demo model (trained weights, head dim 64) over definition-style texts, with the KV cache
in each dtype against fp32 KV: relative logit error, top-1 agreement and perplexity.
`q4-unrotated` is an ablation (the same 4-bit codes without the Hadamard rotation) that
shows what the rotation buys. fp32 compute, one session, whole context on the host.

    .venv/bin/python bench/kv_quality.py [--ctx 1024]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moefit.config import ServeConfig  # noqa: E402
from moefit.demo import demo_pack  # noqa: E402
from moefit.runtime import kv_codecs  # noqa: E402
from moefit.runtime.engine import Engine  # noqa: E402

TEXTS = ["lantern: a light enclosed in a case of glass or paper, carried by hand or hung from a post",
         "river: a large natural stream of water flowing in a channel to the sea, a lake or another river",
         "define: harbour. a place on the coast where ships may moor in shelter from the waves",
         "king: the male ruler of an independent state, especially one who inherits the position by right of birth",
         "evening: the period of time at the end of the day, usually from about six o'clock until bedtime",
         "to whisper: to speak very softly using one's breath without one's vocal cords, so as to be private"]


def teacher_forced(pack, kv_dtype: str, ids: list[int], ctx: int) -> torch.Tensor:
    engine = Engine.open(pack, ServeConfig(ctx=ctx, prefill_chunk=len(ids), kv_dtype=kv_dtype))
    h = engine.model.forward(torch.tensor(ids), 0, engine.loaded.kv, engine.runner)
    return engine.model.logits(h)                                                     # [T, V]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ctx", type=int, default=1024)
    args = ap.parse_args()
    pack = demo_pack(log=lambda *_: None)
    codec = Engine.open(pack, ServeConfig(ctx=64)).codec
    ids = [t for text in TEXTS for t in codec.encode(text + "\n")][: args.ctx]
    ref = teacher_forced(pack, "fp32", ids, args.ctx)
    target = torch.tensor(ids[1:])
    print(f"demo model, {len(ids)} tokens teacher-forced, fp32 compute, {torch.get_num_threads()} threads")
    print(f"{'KV dtype':<14} {'bytes/token':>11} {'rel. logit err':>15} {'top-1 agree':>12} {'perplexity':>11}")
    for name in ("fp32", "bf16", "int8", "k8v4", "q4", "q4-unrotated"):
        dtype, rotate = name.split("-")[0], not name.endswith("unrotated")
        saved = kv_codecs.rotation_matrix
        if not rotate:
            kv_codecs.rotation_matrix = lambda d: torch.eye(d)
        try:
            got = teacher_forced(pack, dtype, ids, args.ctx)
        finally:
            kv_codecs.rotation_matrix = saved
        rel = float((got - ref).norm() / ref.norm())
        agree = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
        ppl = math.exp(float(torch.nn.functional.cross_entropy(got[:-1], target)))
        fp = Engine.open(pack, ServeConfig(ctx=64)).loaded.pack.model
        per_token = sum(s.bytes_per_token(dtype) for s in fp.layer_states())
        print(f"{name:<14} {per_token:>11} {rel:>15.4f} {agree:>12.3f} {ppl:>11.3f}")


if __name__ == "__main__":
    main()

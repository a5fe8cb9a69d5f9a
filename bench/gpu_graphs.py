"""The device check's look at --decode-graphs (runtime/decode_graphs.py): the same greedy tokens
with a decode step's pieces recorded and replayed as without, in fp32 and in the device's
default dtype, on a first request (the pieces recorded) and a second (replayed only); what
was recorded, replayed and held; the hand-off's waits and torch's sync warnings with them.
Then gpt-oss's sinks and sliding layers kept as rings (`rings`: two random layers of its
architecture, width 256, fp32 experts, a window of 16 in 32 slots, wrapped twice a request:
each step's logits against the forward's, within 1e-5 in fp32)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from bench.gpu_check import _first_difference, cfg, tokens, watching_syncs
from bench.gpu_kernels import small_pack
from moefit.runtime.engine import Engine

# 16 + 16 slots for a window of 16; every expert on the card (2 layers of 8), and fp32 experts: a
# simulated card's experts are the host kernel's, whose int8 activations (for any block kind) turn a
# 3e-7 difference into 4e-4 now and then, when one element rounds the other way
RINGS = dict(compute_dtype="fp32", ctx=256, prefill_chunk=16, expert_cache="16", min_expert_slots=0)
GOAL = 1e-5              # the logits' worst relative difference (the simulated card's tape: ~3e-7)


def check_graphs(device: str, pack) -> dict:
    out = {}
    for dtype in ("fp32", "auto"):
        off = tokens(Engine.open(pack, cfg(device, compute_dtype=dtype)), 48)
        engine = Engine.open(pack, cfg(device, compute_dtype=dtype, decode_graphs="on"))
        first = tokens(engine, 48)
        again = watching_syncs(engine, device, lambda: tokens(engine, 48))    # every piece replayed
        out[dtype] = {"same_tokens": first == off and again.pop("result") == off,
                      "first_difference": _first_difference(off, first), **engine.decode_graphs_json(), **again}
    out["rings"] = check_rings(device)
    fp32 = out["fp32"]
    out["ok"] = None if not fp32["on"] else fp32["same_tokens"] and fp32["broken"] is None and out["rings"]["ok"]
    return out


def check_rings(device: str) -> dict:
    """A random model's greedy tokens say little (one token over and over), so each decode step's
    logits over 72 random tokens are compared, fed the same tokens, through the rings' wraps and
    an eager 20-token forward in between (the card's copy of the slots' positions made again)."""
    pack = small_pack("gpt-oss-20b", "fp32", Path(tempfile.mkdtemp()), 256, layers=2, sliding_window=16)
    feed = torch.randint(3, 1000, (72,), generator=torch.Generator().manual_seed(7)).tolist()
    off = _fed(Engine.open(pack, cfg(device, **RINGS)), feed)
    engine = Engine.open(pack, cfg(device, decode_graphs="on", **RINGS))
    on = _fed(engine, feed)
    again = watching_syncs(engine, device, lambda: _fed(engine, feed))     # every piece replayed
    worst = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(off, on + again.pop("result")))
    return {"ok": worst < GOAL and engine.graphs.broken is None, "worst": worst, "goal": GOAL,
            **engine.decode_graphs_json(), **again}


def _fed(engine: Engine, feed: list[int]) -> list[torch.Tensor]:
    """Each step's logits: one token at a time, 20 at once from position 30 (more than a step takes)."""
    engine.prefill(feed[:4])
    out = [engine.forward([feed[p]], p).float().cpu() for p in range(4, 30)]
    out.append(engine.forward(feed[30:50], 30).float().cpu())
    return out + [engine.forward([feed[p]], p).float().cpu() for p in range(50, len(feed))]

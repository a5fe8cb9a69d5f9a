"""The device check's look at --decode-graphs (runtime/decode_graphs.py): the same greedy tokens
with a decode step's pieces recorded and replayed as without, in fp32 and in the device's
default dtype, on a first request (the pieces recorded) and a second (replayed only); what
was recorded, replayed and held; the hand-off's waits and torch's sync warnings with them."""

from __future__ import annotations

from bench.gpu_check import _first_difference, cfg, tokens, watching_syncs
from moefit.runtime.engine import Engine


def check_graphs(device: str, pack) -> dict:
    out = {}
    for dtype in ("fp32", "auto"):
        off = tokens(Engine.open(pack, cfg(device, compute_dtype=dtype)), 48)
        engine = Engine.open(pack, cfg(device, compute_dtype=dtype, decode_graphs="on"))
        first = tokens(engine, 48)
        again = watching_syncs(engine, device, lambda: tokens(engine, 48))    # every piece replayed
        out[dtype] = {"same_tokens": first == off and again.pop("result") == off,
                      "first_difference": _first_difference(off, first), **engine.decode_graphs_json(), **again}
    fp32 = out["fp32"]
    out["ok"] = None if not fp32["on"] else fp32["same_tokens"] and fp32["broken"] is None
    return out

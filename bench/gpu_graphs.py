"""The device check's look at --decode-graphs (runtime/decode_graphs.py): the same greedy tokens
with a decode step's pieces recorded and replayed as without, in fp32 and in the device's
default dtype, on a first request (the pieces recorded) and a second (replayed only); what
was recorded, replayed and held; the hand-off's waits and torch's sync warnings with them."""

from __future__ import annotations

import warnings

import torch

from bench.gpu_check import PROMPT, _first_difference, cfg, tokens
from moefit.runtime.engine import Engine


def check_graphs(device: str, pack) -> dict:
    out = {}
    for dtype in ("fp32", "auto"):
        off = tokens(Engine.open(pack, cfg(device, compute_dtype=dtype)), 48)
        engine = Engine.open(pack, cfg(device, compute_dtype=dtype, decode_graphs="on"))
        first, again = tokens(engine, 48), _watching_syncs(engine, device)
        out[dtype] = {"same_tokens": first == off and again["tokens"] == off,
                      "first_difference": _first_difference(off, first), **engine.decode_graphs_json(),
                      **{k: v for k, v in again.items() if k != "tokens"}}
    fp32 = out["fp32"]
    out["ok"] = None if not fp32["on"] else fp32["same_tokens"] and fp32["broken"] is None
    return out


def _watching_syncs(engine: Engine, device: str) -> dict:
    """A second request's tokens (every piece replayed), with its hand-offs and sync warnings a MoE layer-token."""
    runner, layers = engine.runner, len(engine.pack.model.moe_layers)
    before, tokens_before = runner.handoffs, runner.tokens
    cuda = device.startswith("cuda")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            got = tokens(engine, 48)
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
    decoded = max(1, runner.tokens - tokens_before)
    synced = sum("synchroniz" in str(w.message).lower() for w in caught)
    return {"tokens": got, "handoffs_per_moe_layer_token": (runner.handoffs - before) / decoded / layers,
            "sync_warnings_per_moe_layer_token": synced / decoded / layers if cuda else None}

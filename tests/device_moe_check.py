"""Run by tests/test_device_moe.py in a process with TRITON_INTERPRET=1: the slot-table kernels
(kernels/device_moe.py) on a simulated card's pool, against each expert's SwiGLU in fp32, and
the runner taking them. Prints one JSON line.

    python tests/device_moe_check.py CARD PACK...      # the first pack also runs the engine checks
    python tests/device_moe_check.py --super-blocks CARD PACK...    # GGUF packs: kernels; the last's greedy
                                                                      # (also gpt-oss's: its int4 and MXFP4 packs)
"""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

assert os.environ.get("TRITON_INTERPRET") == "1"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gpu_kernels import kernel_error  # noqa: E402  (the device check's, shared)
from moefit.config import ServeConfig  # noqa: E402
from moefit.kernels import device_moe  # noqa: E402
from moefit.pack.reader import Pack  # noqa: E402
from moefit.runtime.engine import Engine  # noqa: E402
from moefit.runtime.sampler import SamplingParams  # noqa: E402

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def open_engine(pack: str, card: str, cache: str = "auto", ahead: int = 0, graphs: str = "off") -> Engine:
    return Engine.open(pack, ServeConfig(device=f"sim:{card}", ctx=64, vram_reserve_mib=1, low_headroom_mib=0,
                                         min_expert_slots=0, expert_cache=cache, prefetch_per_layer=ahead,
                                         decode_graphs=graphs))


@contextmanager
def fp32_host():
    """The host computes its experts in torch, in fp32 as the kernels do, for the checks that want
    the same tokens with the kernels and without: the native call rounds activations to 8 bits,
    ~0.05 on these logits, enough to flip a router's near-tie (gpt-oss's MXFP4 file on an AMD
    host: 0.4722 against 0.4713 at layer 2, and then a token)."""
    from moefit import kernels
    native, kernels.usable = kernels.usable, lambda x, quant: False
    try:
        yield
    finally:
        kernels.usable = native


def greedy(pack: str, card: str, params: SamplingParams = GREEDY, pieces: bool = True) -> dict:
    """The same greedy tokens with the kernels and without, with a quarter of the experts cached
    and the look-ahead swapping them between steps (so the table's rows change and go down again);
    and, with `pieces`, with the kernels between the recorded pieces of --decode-graphs, as a card
    runs them (what the pieces record does not depend on how the experts are stored: one pack
    kind checks it)."""
    with fp32_host():
        return _greedy(pack, card, params, pieces)


def _greedy(pack: str, card: str, params: SamplingParams, pieces: bool) -> dict:
    runs = {}
    for fused, graphs in ((False, "off"), (True, "off")) + (((True, "on"),) if pieces else ()):
        engine = open_engine(pack, card, cache="4", ahead=2, graphs=graphs)
        engine.runner.fused.on_host = fused
        tokens = engine.generate([5, 17, 42, 99, 7, 3], params)[1].generated
        r = engine.runner
        runs[fused, graphs] = {"tokens": tokens, "sent": r.table.sent, "handoffs": r.handoffs, "swaps": r.book.swaps,
                               "steps": r.fused.steps, "replays": engine.graphs.replays if engine.graphs else 0}
    on, off = runs[True, "off"], runs[False, "off"]
    out = {"same_tokens": on["tokens"] == off["tokens"], "rows_sent": on["sent"],
           "same_handoffs": on["handoffs"] == off["handoffs"], "swaps": on["swaps"],
           "fused_steps": on["steps"], "fused_steps_off": off["steps"]}
    if pieces:
        recorded = runs[True, "on"]
        out.update(pieces_same_tokens=recorded["tokens"] == off["tokens"], pieces_fused_steps=recorded["steps"],
                   pieces_replays=recorded["replays"], pieces_same_handoffs=recorded["handoffs"] == off["handoffs"])
    return out


def all_resident(pack: str, card: str) -> dict:
    """Every expert cached: the layers run without a wait, their routing counted later
    (ExpertRunner.catch_up). The same tokens, hit counts, profile and look-ahead recall as the
    grouped path's, with one wait a forward instead of one a layer."""
    runs = {}
    for fused in (False, True):
        with fp32_host():
            runs[fused] = _all_resident_run(pack, card, fused)
    on, off = runs[True], runs[False]
    return {"same": {k: on[k] == off[k] for k in ("tokens", "hits", "misses", "profile", "recall")},
            "handoffs": on["handoffs"], "handoffs_off": off["handoffs"], "forwards": on["forwards"],
            "layers": on["layers"]}


def _all_resident_run(pack: str, card: str, fused: bool) -> dict:
    engine = open_engine(pack, card, cache=str(len(Pack.open(pack, checksums=False).blobs)), ahead=2)
    r = engine.runner
    assert all(r.table.full(layer) for layer in engine.pack.model.moe_layers)
    r.fused.on_host = fused
    tokens = engine.generate([5, 17, 42, 99, 7, 3], GREEDY)[1].generated
    return {"tokens": tokens, "hits": r.book.hits.tolist(), "misses": r.book.misses.tolist(),
            "profile": r.profile.counts.tolist(), "recall": r.ahead.recall(), "handoffs": r.handoffs,
            "forwards": engine.forwards, "layers": len(engine.pack.model.moe_layers)}


def run_error(pack: str, card: str) -> float:
    """A layer step through the runner, 4 token rows, half of the layer's experts cached: the
    kernels' resident part plus the host's misses against the host alone."""
    engine = open_engine(pack, card, cache="4")
    runner, m = engine.runner, engine.pack.model
    layer = m.moe_layers[0]
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, m.hidden_size, generator=gen)
    ids = torch.stack([torch.randperm(m.num_experts, generator=gen)[:m.top_k] for _ in range(4)])
    weights = torch.rand(4, m.top_k, generator=gen)
    host = runner.run(layer, x, ids, weights)
    runner.fused.on_host = True
    fused = runner.run(layer, x, ids, weights)
    assert runner.fused.steps == 1 and 0 < int(runner.table.held(layer).sum()) < m.num_experts
    return float((fused - host).abs().max() / host.abs().max())


def op_counts(pack: str, card: str) -> dict:
    """Torch operations of one decode step's resident experts (every expert of the layer
    cached): the slot-table kernels against the grouped path with its own fused matvec. A
    kernel launch counts as one operation, as CUDA would issue it (the interpreter's own tensor
    traffic is not what a GPU launches)."""
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

    from moefit.experts.groups import Groups
    from moefit.kernels import device_experts, triton_moe

    class CountOps(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            CountOps.ops += 1
            return func(*args, **(kwargs or {}))

    def one_op(fn):
        def launch(*args):
            with _disable_current_modes():
                out = fn(*args)
            CountOps.ops += 1
            return out
        return launch

    engine = open_engine(pack, card)
    runner, m = engine.runner, engine.pack.model
    runner.group = m.top_k
    layer = m.moe_layers[0]
    x = torch.randn(1, m.hidden_size)
    ids, weights = torch.randperm(m.num_experts)[None, :m.top_k], torch.rand(1, m.top_k)
    shape = device_moe.blob_shape(runner.pack.layouts[runner.pack.blobs[(layer, 0)].quant],
                                  runner.pack.blobs[(layer, 0)].quant)
    triton_moe.launch_gate_up, triton_moe.launch_down = one_op(triton_moe.launch_gate_up), one_op(triton_moe.launch_down)
    device_experts._kernel().launch = one_op(device_experts._kernel().launch)
    runner.table.row(layer)                                   # sent at start: not this step's
    counts = {}
    with CountOps():
        runner.fused.queue(layer, x, ids, weights, shape)
    counts["fused"], CountOps.ops = CountOps.ops, 0
    with CountOps():
        runner._device_experts(layer, x, Groups.of(ids, weights))
    counts["grouped"] = CountOps.ops
    return counts


if __name__ == "__main__":
    super_blocks = sys.argv[1] == "--super-blocks"           # GGUF packs: the kernels and greedy of each
    card, packs = sys.argv[1 + super_blocks], sys.argv[2 + super_blocks:]
    result = {"kernel": {os.path.basename(p): kernel_error(open_engine(p, card)) for p in packs}}
    if super_blocks:                                          # the last pack's greedy (a Q4_K_M file's: both kinds)
        # four tokens, not twelve, and no recorded pieces (the int4 pack's run checks them): under
        # Triton's interpreter each forward through its super-blocks takes ~10 s on an AVX2 EPYC
        short = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        result["greedy"] = {os.path.basename(packs[-1]): greedy(packs[-1], card, short, pieces=False)}
        print(json.dumps(result))
        sys.exit()
    result["greedy"] = greedy(packs[0], card)
    result["run"] = run_error(packs[0], card)
    result["all_resident"] = all_resident(packs[0], card)
    result["ops"] = op_counts(packs[0], card)
    print(json.dumps(result))

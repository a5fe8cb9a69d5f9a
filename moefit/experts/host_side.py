"""The host's share of a layer's experts (the runner's misses; every expert where the card's
memory is host memory), started before the layer's bookkeeping and finished after it.

`start` posts the native call (kernels/layer_call.py: a pool worker leads it while the engine
thread goes on) and returns a `HostWork`; `HostWork.result()` joins it, then adds the experts a
prompt chunk runs as GEMMs (`busy`, experts/host_rates.py), which use torch's threads and so wait
for the pool's. Where the native call cannot run the experts (no library, a family's own expert
function it lacks, shapes it does not take), torch computes them one by one in expert order, at
start. The numbers are the same whether the call was posted or run at once.
"""

from __future__ import annotations

import torch

from moefit import kernels
from moefit.experts.groups import Groups, expert_forward, gemm_first
from moefit.pack.quant import qlinear


class HostWork:
    """A layer's host experts in progress: result() gives their [T, E] fp32 sum."""

    def __init__(self, runner, layer: int, x: torch.Tensor, groups: Groups, busy: list[bool],
                 call: kernels.NativeCall | None = None, out: torch.Tensor | None = None):
        self.runner, self.layer, self.x, self.groups, self.busy = runner, layer, x, groups, busy
        self.call, self.out = call, out

    def result(self) -> torch.Tensor:
        if self.out is None:
            out = self.call.result() if self.call is not None else torch.zeros_like(self.x)
            if out is None:                        # shapes the kernel does not take
                out = one_by_one(self.runner, self.layer, self.x, self.groups)
            elif any(self.busy):
                out = gemm_experts(self.runner, self.layer, self.x, self.groups, self.busy, out)
            self.out = out
        return self.out


def start(runner, layer: int, x: torch.Tensor, groups: Groups, busy: list[bool] | None = None) -> HostWork:
    """The experts of `groups` on host memory (a slot of a simulated card, or the pack's map),
    started: one native call, summed in expert order; torch per expert where it cannot. A prompt
    chunk's busy experts run as GEMMs (`busy`: each expert's choice, given or decided)."""
    quant = runner.pack.blobs[(layer, groups.experts[0])].quant
    native = runner.expert_fn is None or runner.native_act is not None
    if not (kernels.usable(x, quant) and native):
        return HostWork(runner, layer, x, groups, [], out=one_by_one(runner, layer, x, groups))
    busy = runner.rates.busy(layer, quant, groups, x.shape[0]) if busy is None else busy
    dots = groups.subset([not b for b in busy]) if any(busy) else groups
    if not dots.experts:
        return HostWork(runner, layer, x, groups, busy)
    act = runner.native_act(layer, dots.experts) if runner.native_act is not None else None
    call = kernels.moe_post(x, quant, runner._shape(quant), runner._pointers(layer, dots.experts), dots.start,
                            dots.rows, dots.weights, act)
    return HostWork(runner, layer, x, groups, busy, call)


def one_by_one(runner, layer: int, x: torch.Tensor, groups: Groups) -> torch.Tensor:
    """Each expert through torch (or the native matrix calls), added in expert order."""
    out = torch.zeros_like(x)
    for i, e in enumerate(groups.experts):
        rows, w = groups.rows_of(i)
        parts, quant = runner._on_host(layer, e)
        y = forward(runner, layer, e)(x[rows], parts, quant)
        out.index_add_(0, rows, y * w[:, None].to(y.dtype))
    return out


def gemm_experts(runner, layer: int, x: torch.Tensor, groups: Groups, busy: list[bool],
                 out: torch.Tensor) -> torch.Tensor:
    """The busy experts of a prompt chunk (groups.busy) added to out as fp32 GEMMs, in expert order."""
    with kernels.torch_threads():
        for i, e in enumerate(groups.experts):
            if busy[i]:
                rows, w = groups.rows_of(i)
                parts, quant = runner._on_host(layer, e)
                y = forward(runner, layer, e)(x[rows], parts, quant, gemm_first)
                out.index_add_(0, rows, y.mul_(w[:, None]))
    return out


def forward(runner, layer: int, e: int):
    """The expert function: the family's own (gpt-oss) or SwiGLU."""
    if runner.expert_fn is None:
        return expert_forward
    return lambda xs, parts, q, linear=qlinear: runner.expert_fn(layer, e, xs, parts, q, linear)

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

from array import array

import torch

from moefit import kernels
from moefit.experts.groups import Groups, expert_forward, gemm_first
from moefit.pack.quant import qlinear


class HostWork:
    """A layer's host experts in progress: result() gives their [T, E] fp32 sum. `groups` may be
    None where the call was posted from the routing (`step`): made from it if ever needed."""

    def __init__(self, runner, layer: int, x: torch.Tensor, groups: Groups | None, busy: list[bool],
                 call: kernels.NativeCall | None = None, out: torch.Tensor | None = None, routing: tuple = ()):
        self.runner, self.layer, self.x, self.groups, self.busy = runner, layer, x, groups, busy
        self.call, self.out, self.routing = call, out, routing

    def result(self) -> torch.Tensor:
        if self.out is None:
            out = self.call.result() if self.call is not None else torch.zeros_like(self.x)
            if out is None:                        # shapes the kernel does not take
                out = one_by_one(self.runner, self.layer, self.x, self.groups or _grouped(*self.routing))
            elif any(self.busy):
                out = gemm_experts(self.runner, self.layer, self.x, self.groups, self.busy, out)
            self.out = out
        return self.out


def start(runner, layer: int, x: torch.Tensor, groups: Groups, busy: list[bool] | None = None) -> HostWork:
    """The experts of `groups` on host memory (a slot of a simulated card, or the pack's map),
    started: one native call, summed in expert order; torch per expert where it cannot. A prompt
    chunk's busy experts run as GEMMs (`busy`: each expert's choice, given or decided)."""
    quant = runner.pack.blobs[(layer, groups.experts[0])].quant
    if not (kernels.usable(x, quant) and _native(runner)):
        return HostWork(runner, layer, x, groups, [], out=one_by_one(runner, layer, x, groups))
    busy = runner.rates.busy(layer, quant, groups, x.shape[0]) if busy is None else busy
    dots = groups.subset([not b for b in busy]) if any(busy) else groups
    if not dots.experts:
        return HostWork(runner, layer, x, groups, busy)
    act = _act(runner, layer)
    if x.shape[0] == 1 and dots.token_weights is not None and len(dots.experts) <= kernels.STEP_MOST:
        call = kernels.step_post(x, quant, runner._shape(quant), runner.host.row(layer, dots.experts),
                                 array("q", dots.experts), array("f", dots.token_weights), act)
        return HostWork(runner, layer, x, groups, busy, call)
    call = kernels.moe_post(x, quant, runner._shape(quant), runner._pointers(layer, dots.experts), dots.start,
                            dots.rows, dots.weights, act.of(dots.experts) if act is not None else None)
    return HostWork(runner, layer, x, groups, busy, call)


def _native(runner) -> bool:
    """Whether the native call runs this runner's experts: SwiGLU, or a family's activation it has."""
    return runner.expert_fn is None or runner.native_act is not None


def _act(runner, layer: int) -> kernels.StepAct | None:
    """The layer's activation for the native call: the family's (gpt-oss), None for SwiGLU."""
    return runner.native_act(layer) if runner.native_act is not None else None


def step(runner, layer: int, x: torch.Tensor, ids: torch.Tensor | array, weights: torch.Tensor | array,
         experts: list[int]) -> HostWork | None:
    """A decode step's experts on host memory posted straight from its routing, before the runner
    groups it: the router's ids [1, k] (int64) and weights [1, k] as they are, or arrays of the
    experts to compute (a card's misses); `experts` the ids as a list. The kernel sorts them and
    reads their addresses from the layer's row (experts/host_table.py). None where `start` must
    do it (a family's expert function the call lacks, a library or shapes it lacks)."""
    quant = runner.pack.blobs[(layer, experts[0])].quant
    if not _native(runner) or not kernels.usable(x, quant) or not 0 < len(experts) <= kernels.STEP_MOST:
        return None
    if isinstance(ids, torch.Tensor):
        if ids.dtype != torch.int64 or not ids.is_contiguous():
            return None
        if weights.dtype != torch.float32 or not weights.is_contiguous():
            weights = weights.float().contiguous()
    call = kernels.step_post(x, quant, runner._shape(quant), runner.host.row(layer, experts), ids, weights,
                             _act(runner, layer))
    return HostWork(runner, layer, x, None, [], call, routing=(experts, weights))


def route_step(runner, layer: int, x: torch.Tensor, router: kernels.Router
               ) -> tuple[HostWork | None, torch.Tensor, torch.Tensor] | None:
    """A decode step on host memory (every expert is, as in `step`) routed by the family's router
    (kernels.Router) and its experts posted in one native call (kernels.route_post): (the HostWork,
    the router's ids [1, k] and weights [1, k]: its numbers). Where an expert's parts are not in the
    layer's row yet, the call only routes and `step` fills them and posts (its None: `start` will).
    None where it does not apply (nothing done: the family routes and the runner posts)."""
    quant = runner.pack.blobs[(layer, 0)].quant
    if x.shape[0] != 1 or not _native(runner) or not kernels.usable(x, quant) or not router.takes(x) \
            or runner.fused.shape(layer, x) is not None:
        return None
    routed = kernels.route_post(x, router, quant, runner._shape(quant), runner.host.current(layer),
                                _act(runner, layer))
    if routed is None:
        return None
    call, ids, weights = routed
    if call is None:
        return step(runner, layer, x, ids, weights, ids.tolist()[0]), ids, weights
    return HostWork(runner, layer, x, None, [], call, routing=(ids, weights)), ids, weights


def _grouped(experts: list[int] | torch.Tensor, weights: torch.Tensor | array) -> Groups:
    """A step's groups from its experts and their weights (where the call was posted without them)."""
    listed = lambda v: v.reshape(-1).tolist() if isinstance(v, torch.Tensor) else list(v)  # noqa: E731
    return Groups.of_token(listed(experts), listed(weights))


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

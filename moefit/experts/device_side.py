"""The device's part of a MoE layer: its resident experts, from their pool slots.

Two ways, both summing in fp32 (experts/runner.py picks):

    fused   a step of at most DENSE_TOKENS rows of experts stored as int4, Q8_0, int8, Q4_K /
            Q5_K / Q6_K / IQ4_XS super-blocks (a Q4_K_M file's mixed layers too) or MXFP4, SwiGLU
            or gpt-oss's clamped one (the family's fused_act), on CUDA with Triton: two launches
            over the slot table and the router's ids still on the device (kernels/device_moe.py),
            queued before the hand-off's wait, so the resident experts run while the host waits
            and computes the misses. Which experts it covered is the table's row as sent
            (SlotTable.held), not a decision of the host's.
    grouped everything else (prefill chunks, floats, a family's own expert function without a
            fused_act): the experts the host found resident after the hand-off, `runner.group`
            at a time (experts/grouped.py).
"""

from __future__ import annotations

import numpy as np
import torch

from moefit.experts.grouped import DENSE_TOKENS, combine_matrix, grouped_swiglu, padded_rows, stack_parts, swiglu_each
from moefit.experts.groups import Groups
from moefit.kernels import device_moe


class Fused:
    """The fused kernels' readiness for a runner's layers: each quant's blob shape, found once."""

    def __init__(self, runner):
        self.runner = runner
        self.on_host = False                   # the tests: run them on a host-memory card (Triton's interpreter)
        self._shapes: dict[str, device_moe.BlobShape | None] = {}
        self.steps = 0                         # layer steps the kernels took
        self.act = None                        # a family's own expert function for them: layer -> ClampedAct

    def shape(self, layer: int, x: torch.Tensor) -> device_moe.BlobShape | None:
        """The layer's blob shape where the fused kernels take this step, else None."""
        r = self.runner
        if (r.table is None or (r.expert_fn is not None and self.act is None) or x.shape[0] > DENSE_TOKENS
                or not (x.is_cuda or self.on_host) or not device_moe.usable(x)):
            return None
        quant = r.pack.blobs[(layer, 0)].quant
        if quant not in self._shapes:
            self._shapes[quant] = device_moe.blob_shape(r.pack.layouts[quant], quant)
        return self._shapes[quant]

    def queue(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
              shape: device_moe.BlobShape) -> tuple[torch.Tensor, np.ndarray] | None:
        """The layer's resident experts queued on the device: (their sum [T, E] fp32, which
        experts the table held for them); None where the kernels do not compile here."""
        table = self.runner.table
        held = table.held(layer).copy()
        act = self.act(layer) if self.act is not None else None
        out = device_moe.resident_sum(x, ids, weights.float(), table.row(layer), table.base, shape, act)
        if out is None:
            return None
        self.steps += 1
        return out, held


    def may_defer(self, layer: int) -> bool:
        """Every expert of the layer is on the card, and of the layer the look-ahead would bring
        experts in for next: nothing needs the routing on the host now."""
        r = self.runner
        if r.dump is not None or not r.table.full(layer):
            return False
        if r.ahead is None:
            return True
        moe = r.ahead.moe_layers
        return r.table.full(next((m for m in moe if m > layer), moe[0] if moe else -1))

    def all_resident(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                     shape: device_moe.BlobShape, guess) -> torch.Tensor | None:
        """The layer's experts, all resident, queued with no wait: its routing comes to the host
        later (ExpertRunner.catch_up) for the profile, the hit counts and the look-ahead."""
        early = self.queue(layer, x, ids, weights, shape)
        if early is None:
            return None
        self.runner.defer(layer, guess, self.runner.handoff.later(ids, weights, guess[1] if guess else None))
        return early[0].to(x.dtype)


def grouped(runner, layer: int, x: torch.Tensor, groups: Groups) -> torch.Tensor:
    """Resident experts on the device from their pool slots, summed in fp32; every launch is
    queued (rows and weights go down from pinned memory without a wait). `group` at a time
    (experts/grouped.py): a step of a few rows on all its rows, a prefill chunk on each
    expert's own rows; a family's own expert function (gpt-oss) grouped the same way."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    if not groups.experts:
        return out
    quant = runner.pack.blobs[(layer, groups.experts[0])].quant
    if x.shape[0] <= DENSE_TOKENS:
        combine = down(combine_matrix(len(groups.experts), x.shape[0], groups.rows, groups.start, groups.weights),
                       x.device)
        for a in range(0, len(groups.experts), runner.group):
            members = groups.experts[a:a + runner.group]
            views = [runner.slots[(layer, e)] for e in members]
            out += grouped_swiglu(x, stack_parts(views), quant, combine[a:a + runner.group], runner.slice_weights,
                                  group_act(runner, layer, members, x.device))
        return out
    # experts of similar row counts together, at most top-k of them: padded to the longest, a
    # group's rows are then at most the chunk's top-k pairs, the prompt path's activations
    step = min(runner.group, runner.pack.model.top_k)
    spans = sorted((groups.start[i + 1] - groups.start[i], i) for i in range(len(groups.experts)))
    for a in range(0, len(spans), step):
        members = [i for _, i in spans[a:a + step]]
        index, weight = padded_rows([(groups.start[i], groups.start[i + 1]) for i in members], groups.rows,
                                    groups.weights)
        index_d, weight_d = down(index, x.device), down(weight, x.device)
        experts = [groups.experts[i] for i in members]
        views = [runner.slots[(layer, e)] for e in experts]
        y = swiglu_each(x[index_d], stack_parts(views), quant, runner.slice_weights,
                        group_act(runner, layer, experts, x.device))                              # [m, R, E]
        out.index_add_(0, index_d.flatten(), y.float().mul_(weight_d[:, :, None]).flatten(0, 1))
    return out


def group_act(runner, layer: int, experts: list[int], device: torch.device):
    """The family's expert function for these experts on the device (None: SwiGLU)."""
    if runner.group_act is None:
        return None
    return runner.group_act(layer, down(torch.tensor(experts), device))


def down(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on the device without a wait (through pinned memory on CUDA)."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)

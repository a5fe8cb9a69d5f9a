"""One MoE layer's hand-off between the device and the host: the only place a layer's
experts synchronise with the device, and where that is counted.

    sent = handoff.send(x, ids, weights)      # one copy of the routing and the hidden rows
    ...                                        # the device's resident experts, queued after it
    rows = handoff.wait(sent)                  # the layer's one wait
    ...                                        # while the host computes the misses
    out = out_device + handoff.to_device(y)    # the host's sum goes back without a sync

On CUDA the router's ids and weights and the hidden rows go into pinned host buffers with
non-blocking copies, and one event is waited on: one synchronisation per MoE layer. The
host's result goes back through pinned memory with a non-blocking copy that the stream
orders before the add, so the device never waits for the host. On the host (cpu, a
simulated card) the tensors are already there; the exchange is still counted, once a layer,
so `expert_cache.handoffs_per_token` reads the same on every device kind (DESIGN.md).
"""

from __future__ import annotations

import torch


class Handoff:
    def __init__(self):
        self.syncs = 0                         # device -> host waits: one per MoE layer forward
        self._pinned: dict[str, torch.Tensor] = {}

    def to_host(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor):
        """(x, ids, weights) on the host; at most one wait."""
        return self.wait(self.send(x, ids, weights))

    def send(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, guess: torch.Tensor | None = None):
        """Queue the copies to the host without waiting: work the stream queues after this (the
        resident experts) runs while the host waits for them (`wait`). `guess`: the look-ahead's
        ids for the next layer, made before this layer's MoE, ride along (no wait of their own)."""
        if x.device.type == "cpu":
            return ((x, ids, weights) if guess is None else (x, ids, weights, guess)), None
        sent = (("x", x), ("ids", ids), ("weights", weights)) + ((("guess", guess),) if guess is not None else ())
        out = tuple(self._pin(name, t).copy_(t, non_blocking=True) for name, t in sent)
        event = torch.cuda.Event()
        event.record()
        return out, event

    def later(self, ids: torch.Tensor, weights: torch.Tensor, guess: torch.Tensor | None = None):
        """A fully resident layer's routing, copied to the host without a wait into buffers of its
        own (several layers' may be in flight): `wait` on the last of them reads them all."""
        sent = (ids, weights) + ((guess,) if guess is not None else ())
        if ids.device.type == "cpu":
            return sent, None
        out = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True) for t in sent)
        event = torch.cuda.Event()
        event.record()
        return out, event

    def wait(self, sent) -> tuple[torch.Tensor, ...]:
        """The sent tensors on the host: one synchronisation, counted."""
        out, event = sent
        self.syncs += 1
        if event is not None:
            event.synchronize()
        return out

    def fetch(self, t: torch.Tensor) -> torch.Tensor:
        """A small device tensor on the host (the look-ahead's predicted ids where no MoE hand-off
        follows to carry them: the layer computing now is dense): a wait, counted."""
        if t.device.type == "cpu":
            return t
        self.syncs += 1
        return t.cpu()

    def to_device(self, y: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """The host's result [T, E] on like's device and dtype, without waiting."""
        if like.device.type == "cpu":
            return y.to(like.dtype)
        # pin_memory() takes a block from torch's caching host allocator, which is not reused
        # before the copy that reads it has run: no wait here, and no buffer overwritten early
        return y.pin_memory().to(like.device, non_blocking=True).to(like.dtype)

    def _pin(self, name: str, t: torch.Tensor) -> torch.Tensor:
        buf = self._pinned.get(name)
        if buf is None or buf.numel() < t.numel() or buf.dtype != t.dtype:
            buf = self._pinned[name] = torch.empty(max(t.numel(), 1), dtype=t.dtype, pin_memory=True)
        return buf[: t.numel()].view(t.shape)

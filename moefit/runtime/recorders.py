"""Record a piece of a forward once and replay it: a CUDA graph on CUDA, a tape on the CPU.

    rec = recorder_for(device)            # CudaGraphs(...) on CUDA, Tape() on a simulated card
    replay = rec.record(piece)            # piece() runs once (this step's result) and is recorded
    replay()                              # the recorded operations again, on the same tensors

Both keep CUDA graphs' contract: the tensors a piece reads and writes stay where they were
recorded, Python runs only while recording (a Python int, a branch, a shape is frozen in), and a
piece may not wait for the device (`.item()`, a device-to-host copy it reads, nonzero). The tape
replays the aten operations the piece issued, each on the tensors it was recorded with, writing
its result over the recorded result: a CPU run then computes what a graph would, including what
a frozen Python value gets wrong, so the CPU's tests see it (tests/test_decode_graphs.py).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moefit import kernels

SYNCING = ("aten._local_scalar_dense", "aten.is_nonzero", "aten.equal", "aten.nonzero", "aten.masked_select",
           "aten.unique", "aten._unique", "aten.item", "aten.repeat_interleave.Tensor")   # each waits for a value


class RecordError(RuntimeError):
    """A piece that cannot be recorded (it waits for the device, or the capture failed)."""


class Tape:
    """The CPU's stand-in for a CUDA graph: the aten operations of one run, replayed in order."""

    kind = "tape"

    def __init__(self):
        self.pool_bytes = 0

    def record(self, piece: Callable[[], None]) -> Callable[[], None]:
        recording = _Recording()              # recording runs it: this step's result
        with kernels.host_calls_off(), recording:   # a native call is no aten operation: the tape could not replay it
            piece()
        self.pool_bytes += recording.nbytes
        return recording.replay


class _Recording(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[tuple] = []
        self.nbytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _waits(func, args):
            raise RecordError(f"{func} waits for the device: a recorded piece may not")
        out = func(*args, **kwargs)
        fresh = [t for t in _tensors(out) if not _aliases(t, args, kwargs)]
        self.nbytes += sum(t.untyped_storage().nbytes() for t in fresh)
        self.ops.append((func, args, kwargs, out, {id(t) for t in fresh}))
        return out

    def replay(self) -> None:
        for func, args, kwargs, out, fresh in self.ops:
            again = func(*args, **kwargs)
            for was, now in zip(_tensors(out), _tensors(again)):
                if id(was) in fresh:
                    was.copy_(now)


def _waits(func, args) -> bool:
    """Whether the operation needs a value from the device before it can go on: an item, a
    data-dependent size, or indexing by a boolean mask (which finds its True positions first)."""
    name = str(func)
    if any(name.startswith(s) for s in SYNCING):
        return True
    if name.startswith(("aten.index.Tensor", "aten.index_put")) and len(args) > 1:
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] or ())
    return False


def _tensors(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for t in out if isinstance(t, torch.Tensor)]
    return []


def _aliases(t: torch.Tensor, args, kwargs) -> bool:
    """Whether t shares memory with an input (a view, an in-place result): replaying the
    operation has already written it."""
    ptr = t.untyped_storage().data_ptr()
    inputs = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    inputs += [x for a in args if isinstance(a, (list, tuple)) for x in a if isinstance(x, torch.Tensor)]
    return any(x.untyped_storage().data_ptr() == ptr for x in inputs)


class CudaGraphs:
    """CUDA graphs sharing one memory pool: pieces replay one after another on one stream, and
    what one piece leaves for the next is in tensors made outside the pool, so one piece's
    scratch may reuse another's. pool_bytes: what the pool took from the card (the reserve holds it)."""

    kind = "cuda graph"

    def __init__(self, device: torch.device):
        self.device, self.pool = device, torch.cuda.graph_pool_handle()
        self.side = torch.cuda.Stream(device)       # every capture on one stream: cuBLAS keeps a workspace a stream
        self.pool_bytes = 0

    def record(self, piece: Callable[[], None]) -> Callable[[], None]:
        graph, side, main = torch.cuda.CUDAGraph(), self.side, torch.cuda.current_stream(self.device)
        side.wait_stream(main)
        try:
            with torch.cuda.stream(side):
                piece()                             # this step's result (a capture runs nothing), on the capture's
                before = torch.cuda.memory_reserved(self.device)   # stream: its lazy set-ups happen here
                self._capture(graph, piece)
        finally:
            main.wait_stream(side)
        self.pool_bytes += torch.cuda.memory_reserved(self.device) - before
        return graph.replay

    def _capture(self, graph, piece) -> None:
        try:                                        # thread_local: the stager's copies go on during a capture
            graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                piece()
            finally:
                graph.capture_end()
        except Exception as e:                      # noqa: BLE001  (the step ran eagerly: only later ones lose the graph)
            raise RecordError(f"CUDA graph capture failed: {type(e).__name__}: {e}") from e


def recorder_for(device: torch.device):
    return CudaGraphs(device) if device.type == "cuda" else Tape()

"""Gated DeltaNet's per-layer state (Qwen3.5 / 3.6, Qwen3-Next), one of the state objects that
runtime/state.py's SequenceState holds for a session: the recurrence's matrix and conv window, the
snapshot a multi-token forward resumes from, a verify window's checkpoints, and the prompts' marks."""

from __future__ import annotations

import torch

from moefit.errors import MoefitError
from moefit.families.state import PROMPT_MARKS, RecurrentState
from moefit.memory.ledger import KV as LINE, VERIFY
from moefit.runtime.placement import DeviceMemory


class StateLost(MoefitError):
    """A recurrent layer asked to resume from a position it holds no state for."""


CHECKPOINT_LINE = VERIFY        # a verify window's per-position states live in the reserve's arena


class RecurrentLayerState:
    """Gated DeltaNet's state of one layer: s [H, Dk, Dv] fp32 and the conv window [C, K-1].
    A recurrence cannot be cut at an arbitrary position, so each multi-token forward first
    snapshots the state at its start: a prompt that shares a prefix up to that point resumes
    from it. Position 0 is always resumable (zeros).

    A verify window (checkpoint() before its forward) also keeps the state after each of its
    positions but the last, and its conv inputs: keep(n) then puts the layer at the window's
    start + n at the price of one copy. bench/rollback.py measured the ways back on the host
    (Qwen3.6's shape, 3 DeltaNet layers, 4 drafts; bench/results/rollback.txt): with checkpoints
    a rejection costs 0.9 ms and the window's forward is no slower (the recurrent form is
    faster than the chunked one on 5 rows); replaying the kept tokens through the DeltaNet
    layers would cost 11-40 ms, running them through the whole model again (the first round's
    way) 33-80 ms. The price is memory: k state matrices per layer
    during a window, in the verify arena (240 MiB for Qwen3.6-35B-A3B at 4 drafts).

    The next turn of a chat shares the last prompt and, mostly, only part of the reply (a
    template drops the reply's thinking, a client reformats a tool call), and a verify window's
    snapshot is past that point: so the state at each prompt's end is kept too (`mark`), the
    last PROMPT_MARKS of them, in host memory (pinned on CUDA; Qwen3.6-35B-A3B: 60 MiB each)."""

    def __init__(self, decl: RecurrentState, compute_dtype: torch.dtype, mem: DeviceMemory):
        def two(shape, dtype):
            return [mem.empty(LINE, shape, dtype).zero_() for _ in range(2)]
        self.mem = mem
        self.s, self.snap_s = two((decl.heads, decl.k_dim, decl.v_dim), torch.float32)
        self.conv, self.snap_conv = two((decl.conv_channels, decl.conv_kernel - 1), compute_dtype)
        self.pos, self.snap_pos = 0, None
        self.checkpointing = False             # set for a verify window's forward
        self.saved: torch.Tensor | None = None  # [T-1, H, Dk, Dv]: s after positions 1..T-1 of the window
        self.conv_inputs: torch.Tensor | None = None
        self.marks: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}   # position -> (s, conv), oldest first
        self._pin = mem.torch_device.type == "cuda"

    rotations = (None, None)
    window = None

    def begin(self, start: int, t: int) -> None:
        """Called by the layer before it consumes tokens start..start+t."""
        self._drop_saved()
        if start == 0:
            self.s.zero_()
            self.conv.zero_()
        elif start == self.snap_pos and start != self.pos:
            self.s.copy_(self.snap_s)
            self.conv.copy_(self.snap_conv)
        elif start in self.marks and start != self.pos:
            self.marks[start] = s, conv = self.marks.pop(start)           # the most recently used now
            self.s.copy_(s, non_blocking=self._pin)
            self.conv.copy_(conv, non_blocking=self._pin)
        elif start != self.pos:
            raise StateLost(f"recurrent state is at position {self.pos}, asked to resume at {start}")
        if t > 1:
            self.snap_s.copy_(self.s)
            self.snap_conv.copy_(self.conv)
            self.snap_pos = start
            if self.checkpointing:
                self.saved = self.mem.empty(CHECKPOINT_LINE, (t - 1, *self.s.shape), torch.float32)
        self.pos = start + t

    def save(self, i: int) -> None:
        """The layer's recurrence has consumed position i of the window (i < T-1)."""
        self.saved[i].copy_(self.s)

    def keep(self, kept: int) -> None:
        """Only the window's first `kept` tokens stay: the state after them, from its checkpoint
        (s) and the conv inputs (the conv window is the last K-1 of them, after the snapshot's)."""
        if self.saved is None or self.pos != self.snap_pos + self.saved.shape[0] + 1:
            raise StateLost("no checkpointed window to go back into")
        if kept <= self.saved.shape[0]:
            self.s.copy_(self.saved[kept - 1])
            seq = torch.cat((self.snap_conv, self.conv_inputs[:kept].T.to(self.conv.dtype)), dim=1)
            self.conv.copy_(seq[:, -self.conv.shape[1]:])
            self.pos = self.snap_pos + kept
        self._drop_saved()

    def _drop_saved(self) -> None:
        if self.saved is not None:
            self.mem.free(CHECKPOINT_LINE, self.saved)
        self.saved = self.conv_inputs = None

    def mark(self) -> None:
        """Keep the state at the current position (a prompt's end), in place of the oldest mark."""
        if self.pos == 0 or self.pos in self.marks:
            return
        if len(self.marks) < PROMPT_MARKS:
            s, conv = (torch.empty(t.shape, dtype=t.dtype, pin_memory=self._pin) for t in (self.s, self.conv))
        else:
            s, conv = self.marks.pop(next(iter(self.marks)))
        s.copy_(self.s, non_blocking=self._pin)            # stream-ordered: begin() copies back on the same stream
        conv.copy_(self.conv, non_blocking=self._pin)
        self.marks[self.pos] = s, conv

    def resumable(self, upto: int) -> int:
        return max(p for p in (0, self.pos, self.snap_pos, *self.marks) if p is not None and p <= upto)

    def taken_back(self, pos: int, marks: dict) -> None:
        """s and conv were written back at pos (runtime/kept.py), with these marks: nothing else is held."""
        self._drop_saved()
        self.pos, self.snap_pos, self.marks = pos, None, dict(sorted(marks.items()))

    def truncate(self, pos: int) -> None:
        """Nothing to cut here: the next forward's begin() resumes from `pos` or says it cannot."""

    def host_bytes(self) -> int:
        return sum(t.nbytes for pair in self.marks.values() for t in pair)

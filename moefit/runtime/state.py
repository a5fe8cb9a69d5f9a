"""One sequence-state object per layer, built from the family's declaration
(families/state.py), and the SequenceState that holds them for a session.

AttentionState keeps keys and values by absolute position:

    whole context   a store of C positions on the card; rejecting speculative tokens, or
                    reusing a prompt prefix, needs no code: later writes overwrite the slots.
    ring            a sliding-window layer, or a streaming one (--kv-resident), keeps a ring
                    of R slots on the card, position p in slot p % R. A streaming layer also
                    writes every position through to a host store of the whole context, which
                    serves the positions the ring no longer holds (KV streaming): attention
                    over the two parts is merged by log-sum-exp (models/attention.attend_state).

`parts(end)` returns what attention reads for keys 0..end: (k, v, positions), where
positions None means "contiguous from 0" and otherwise names each row's position (rows
that must not be attended are at INVALID). Rows are in the compute dtype, rotated for q4
(`rotations`); with `stored`, the whole context's part and the host part are StoredRows
instead (kv_codecs.py: the host's native attention reads them without a decoded copy).

Legend: K kv heads, C positions held, D head dim, T tokens written, R ring slots.
"""

from __future__ import annotations

import torch

from moefit.families.state import AttentionKV, LatentKV, RecurrentState, split_kv_dtype
from moefit.memory.ledger import KV
from moefit.runtime.kv_codecs import StoredRows, codec
from moefit.runtime.placement import DeviceMemory
from moefit.runtime.recurrent_state import RecurrentLayerState

LINE = KV
INVALID = 1 << 62


class AttentionState:
    def __init__(self, decl: AttentionKV, ctx: int, kv_dtype: str, compute_dtype: torch.dtype, mem: DeviceMemory,
                 chunk: int, resident: int | None = None, mask_window: int | None = None, line: str = LINE):
        kd, vd = split_kv_dtype(kv_dtype)
        self.kc, self.vc = codec(kd, decl.head_dim), codec(vd, decl.v_head_dim)
        self.compute_dtype, self.ctx = compute_dtype, ctx
        self.window = decl.window or mask_window
        self.own_window = decl.window is not None          # the family's per-layer window, not the model-wide mask
        held = decl.tokens_held(ctx, chunk)
        if resident is not None and decl.streams:
            held = min(held, max(resident, chunk))
        self.capacity = held
        alloc = lambda shape, dtype: mem.empty(line, shape, dtype).zero_()  # noqa: E731  (masked rows meet 0 * row)
        self.k, self.v = self.kc.empty(alloc, decl.kv_heads, held), self.vc.empty(alloc, decl.kv_heads, held)
        self.whole = self._run(0, held)                     # (k, v) as StoredRows over every slot
        self.slot_pos = torch.full((held,), INVALID, dtype=torch.long) if held < ctx else None
        direct = self.slot_pos is None and self.window is None and self.k["x"].is_cpu     # row p is position p
        self._steps_natively = self.k["x"].is_cpu          # host rows of any codec (kernels/kv_write.h)
        self._writable = direct
        self.host, self._copied = None, None
        if self.slot_pos is not None and decl.streams:
            pin = mem.torch_device.type == "cuda"
            host_alloc = lambda shape, dtype: torch.empty(shape, dtype=dtype, pin_memory=pin)  # noqa: E731
            self.host = (self.kc.empty(host_alloc, decl.kv_heads, ctx), self.vc.empty(host_alloc, decl.kv_heads, ctx))

    @property
    def rotations(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self.kc.rotation, self.vc.rotation

    def host_bytes(self) -> int:
        return sum(t.nbytes for store in self.host for t in store.values()) if self.host else 0

    def step_rows(self, pos: int) -> tuple | None:
        """What a native decode step at position pos writes and reads in place (kernels/step.h), where
        this layer's rows are on the host in a codec it writes (any of kv_codecs'): (k, v as StoredRows over
        every slot, the slot it writes, the runs (offset, count) of slots it attends, _slot_runs');
        None where they are not (another codec, a card, a host part, a position the ring no longer
        holds). The caller marks the slot written (`stepped`)."""
        if not self._steps_natively or self.host is not None:
            return None
        runs = self._slot_runs(pos + 1, written=pos)
        slot = pos if self.slot_pos is None else pos % self.capacity
        return None if runs is None else (*self.whole, slot, runs)

    def stepped(self, pos: int, t: int = 1) -> None:
        """Positions pos..pos+t written where this layer's record of a ring does not see it: a native
        step into step_rows' slot, a recorded piece at the device's positions (runtime/decode_graphs.py)."""
        if self.slot_pos is None:
            return
        if t == 1:                                          # the host's decode step: no tensors made
            self.slot_pos[pos % self.capacity] = pos
            return
        written = torch.arange(pos, pos + t)
        self.slot_pos[written % self.capacity] = written

    def writable_rows(self) -> tuple[StoredRows, StoredRows] | None:
        """(k, v) as StoredRows over every slot, where a native decode step may write row `pos` itself
        and read the rows before it (kernels/mla.h): host rows indexed by position in a codec it
        writes (any of kv_codecs'), no ring or window; None otherwise."""
        return self.whole if self._writable else None

    def recent_rows(self, end: int) -> list[tuple[StoredRows, StoredRows]] | None:
        """What a decode step at position end - 1 attends, as runs of rows read in place (_slot_runs);
        None where they cannot be read so (a host part, rows on a card, a position the ring no
        longer holds)."""
        if not self.k["x"].is_cpu or self.host is not None:
            return None
        runs = self._slot_runs(end, written=end)
        return None if runs is None else [self._run(offset, count) for offset, count in runs]

    def _slot_runs(self, end: int, written: int) -> list[tuple[int, int]] | None:
        """The runs (offset, count) of slots holding positions first..end-1 (first: the window's, or 0):
        one run of the whole-context store, or of a ring's slots, two where the ring wraps; None
        where a ring no longer holds one of first..written-1 (a rejected speculative token took its
        slot: the host store or the masked route has it)."""
        first = 0 if self.window is None else max(0, end - self.window)
        if self.slot_pos is None:
            return [(first, end - first)]
        cap, held = self.capacity, torch.arange(first, written)
        if end - first > cap or not bool((self.slot_pos[held % cap] == held).all()):
            return None
        a, b = first % cap, (end - 1) % cap + 1
        return [(a, b - a)] if a < b else [(a, cap - a), (0, b)]

    def _run(self, offset: int, count: int) -> tuple[StoredRows, StoredRows]:
        return StoredRows(self.kc, self.k, count, offset), StoredRows(self.vc, self.v, count, offset)

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k [K, T, Dk], v [K, T, Dv] for positions start..start+T."""
        end = start + k.shape[1]
        if self.slot_pos is None:
            self.kc.put(self.k, slice(start, end), k)
            self.vc.put(self.v, slice(start, end), v)
            return
        if k.shape[1] > self.capacity:
            raise ValueError(f"{k.shape[1]} tokens in one forward exceed the {self.capacity}-slot ring")
        pos = torch.arange(start, end)
        first = start % self.capacity
        slots = slice(first, first + len(pos)) if first + len(pos) <= self.capacity else pos % self.capacity
        put = slots if isinstance(slots, slice) else slots.to(self.k["x"].device)    # a slice: no index_put
        self.kc.put(self.k, put, k)
        self.vc.put(self.v, put, v)
        self.slot_pos[slots] = pos
        if self.host is not None:
            self._write_through(slice(start, end), k, v)

    def _write_through(self, index: slice, k: torch.Tensor, v: torch.Tensor) -> None:
        """Positions `index` to the host store too: coded where the rows are (a card: its codes
        cross PCIe, not the rows), copied into the pinned store without waiting; parts() waits for
        the copy before the host reads it. (Reading a tensor sent to the host with non_blocking
        before its copy is done reads whatever the memory held: the earlier way coded it so.)"""
        for c, store, x in ((self.kc, self.host[0], k), (self.vc, self.host[1], v)):
            coded = c.empty(lambda shape, dtype: torch.empty(shape, dtype=dtype, device=x.device), x.shape[0], x.shape[1])
            c.put(coded, slice(0, x.shape[1]), x)
            for name, t in coded.items():
                store[name][:, index].copy_(t, non_blocking=True)
        if k.is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()

    def parts(self, end: int, stored: bool = False) -> list[tuple]:
        """What attention reads for keys 0..end (the module's docstring); `stored`: the whole
        context's part and the host part as StoredRows, left for the reader to decode."""
        dt = self.compute_dtype

        def rows(codec, store, count):
            return StoredRows(codec, store, count) if stored else codec.get(store, slice(0, count), dt)
        if self.slot_pos is None:
            return [(rows(self.kc, self.k, end), rows(self.vc, self.v, end), None)]
        first = self._first_in_ring(end) if self.host is not None else 0
        if first > 0 and self._copied is not None:
            self._copied.synchronize()                          # the write-through has landed
            self._copied = None
        pos = self.slot_pos.clone()
        pos[(pos < first) | (pos >= end)] = INVALID
        dev = pos.to(self.k["x"].device)
        parts = [(self.kc.get(self.k, slice(0, self.capacity), dt), self.vc.get(self.v, slice(0, self.capacity), dt), dev)]
        if first > 0:
            parts.insert(0, (rows(self.kc, self.host[0], first), rows(self.vc, self.host[1], first), torch.arange(first)))
        return parts

    def _first_in_ring(self, end: int) -> int:
        """The first position from which the ring holds every position up to end (a rejected
        speculative token may have taken the slot of an older one: the host store has it)."""
        idx = torch.arange(max(0, end - self.capacity), end)
        missing = (self.slot_pos[idx % self.capacity] != idx).nonzero()
        return int(idx[missing[-1, 0]]) + 1 if len(missing) else int(idx[0]) if len(idx) else 0

    def truncate(self, pos: int) -> None:
        """Keep positions < pos. Nothing to do: positions are written by index, and a ring's
        positions >= pos are never attended by queries before them."""

    def resumable(self, upto: int) -> int:
        """The longest prefix <= upto a forward can continue after: any for a whole-context store or
        a ring with its host store; for a ring alone, one whose window before it the ring still holds
        (later positions took the slots of older ones: a longer reply, a rejected speculative tail)."""
        if self.slot_pos is None or self.host is not None or upto == 0:
            return upto
        pos = torch.arange(upto)
        lost = torch.where(self.slot_pos[pos % self.capacity] != pos, pos, -1)
        latest_lost = lost.cummax(0).values                     # at or before each position
        first_needed = pos + 2 - self.window if self.window else torch.zeros_like(pos)   # a forward at pos + 1's
        ok = (latest_lost < first_needed).nonzero()
        return int(ok[-1, 0]) + 1 if len(ok) else 0


class SequenceState:
    """The per-layer state objects of one session.

    Usage: state = SequenceState(model_config, ctx, "int8", torch.float32, mem, chunk=512)
           state.write(i, start, k, v); attend_state(state, i, q, start, mask)"""

    def __init__(self, model, ctx: int, kv_dtype: str, compute_dtype: torch.dtype, mem: DeviceMemory,
                 chunk: int, resident: int | None = None, decls: list | None = None, line: str = LINE):
        """`decls` (default: the model's layers) and the ledger `line` they are charged to let a
        draft source hold its own state (the MTP layer's KV, in the reserve)."""
        self.ctx, self.kv_dtype, self.compute_dtype, self.resident = ctx, kv_dtype, compute_dtype, resident
        self.line = line
        self.layers = [self._make(s, model, chunk, mem) for s in (decls or model.layer_states())]

    def _make(self, decl, model, chunk: int, mem: DeviceMemory):
        if isinstance(decl, AttentionKV):
            return AttentionState(decl, self.ctx, self.kv_dtype, self.compute_dtype, mem, chunk, self.resident,
                                  model.sliding_window, self.line)
        if isinstance(decl, LatentKV):                       # one "head": k = the rope key, v = the latent
            return AttentionState(AttentionKV(1, decl.rope_dim, decl.rank), self.ctx, self.kv_dtype,
                                  self.compute_dtype, mem, chunk, self.resident, line=self.line)
        if isinstance(decl, RecurrentState):
            return RecurrentLayerState(decl, self.compute_dtype, mem)
        raise NotImplementedError(f"{type(decl).__name__} state has no runtime object yet")

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.layers[layer].write(start, k, v)

    def step_rows(self, layer: int, pos: int) -> tuple | None:
        state = self.layers[layer]
        return state.step_rows(pos) if isinstance(state, AttentionState) else None

    def stepped(self, layer: int, pos: int) -> None:
        self.layers[layer].stepped(pos)

    def writable_rows(self, layer: int) -> tuple[StoredRows, StoredRows] | None:
        state = self.layers[layer]
        return state.writable_rows() if isinstance(state, AttentionState) else None

    def recent_rows(self, layer: int, end: int):
        state = self.layers[layer]
        return state.recent_rows(end) if isinstance(state, AttentionState) else None

    def parts(self, layer: int, end: int, stored: bool = False):
        return self.layers[layer].parts(end, stored)

    def rotations(self, layer: int):
        return self.layers[layer].rotations

    def window(self, layer: int) -> int | None:
        return self.layers[layer].window

    def own_window(self, layer: int) -> bool:
        """Whether layer's window is its own (gpt-oss's sliding layers) rather than the mask every layer shares."""
        return self.layers[layer].own_window

    def truncate(self, pos: int) -> None:
        for layer in self.layers:
            layer.truncate(pos)

    def host_bytes(self) -> int:
        return sum(layer.host_bytes() for layer in self.layers)

    @property
    def recurrent(self) -> bool:
        return any(isinstance(layer, RecurrentLayerState) for layer in self.layers)

    def checkpoint(self, on: bool) -> None:
        """Recurrent layers keep per-position states during the next forwards (a verify window)."""
        for layer in self.layers:
            if isinstance(layer, RecurrentLayerState):
                layer.checkpointing = on

    def keep(self, kept: int) -> None:
        """After a checkpointed verify window: every recurrent layer at its start + kept."""
        for layer in self.layers:
            if isinstance(layer, RecurrentLayerState):
                layer.keep(kept)

    def mark(self) -> None:
        """A prompt has been consumed: recurrent layers keep their state here (the next turn resumes at it)."""
        for layer in self.layers:
            if isinstance(layer, RecurrentLayerState):
                layer.mark()

    def resumable(self, upto: int) -> int:
        """The longest prefix <= upto every layer can resume after: a recurrent layer at a state it
        kept, a ring where it still holds the window before it, a whole-context store anywhere. Each
        layer's answer is the longest it can at most, so going down until all agree finds it."""
        while (n := min(layer.resumable(upto) for layer in self.layers)) != upto:
            upto = n
        return upto

"""The expert cache's slot pool: preallocated chunks of fixed-size slots per size class on
the device, a (layer, expert) -> slot table, and each slot's state.

    pool = SlotPool(mem, sizes, layers, experts)   # sizes: blob bytes per (layer, expert)
    pool.reserve(keys)                   # the planned chunks, allocated once at start
    view = pool.acquire(key)             # a free slot, now "loading"; copy the blob into it
    pool.ready(key)                      # ... "resident"
    pool.release(key)                    # the slot is free again (its bytes stay allocated)
    pool.trim()                          # move residents out of the emptiest chunks, free those

Only whole chunks are allocated and freed, so the ledger's expert-cache line equals the
pool's allocation and, under the CUDA allocator, what the card reserves for it
(experts/slots.py says why). Slot states: FREE, LOADING (a copy in flight: on CUDA the
look-ahead's side stream), RESIDENT.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np
import torch

from moefit.errors import DeviceOutOfMemory
from moefit.experts.slots import Key, chunk_bytes, chunk_plan, class_counts, stride
from moefit.runtime.placement import DeviceMemory

LINE = "expert cache"
FREE, LOADING, RESIDENT = 0, 1, 2


@dataclass(eq=False)                      # chunks compare by identity
class Chunk:
    storage: torch.Tensor                 # uint8 [nbytes]
    slot_stride: int
    states: np.ndarray                    # int8 [slots]
    keys: list[Key | None] = field(default_factory=list)
    free: list[int] = field(default_factory=list)     # the FREE slots' indices, a heap: the lowest first

    def __post_init__(self):
        self.free = list(range(len(self.states)))

    @property
    def slots(self) -> int:
        return len(self.states)

    @property
    def used(self) -> int:
        return len(self.states) - len(self.free)

    def take(self) -> int:
        return heapq.heappop(self.free)

    def give(self, i: int) -> None:
        heapq.heappush(self.free, i)

    def view(self, i: int, nbytes: int) -> torch.Tensor:
        return self.storage[i * self.slot_stride: i * self.slot_stride + nbytes]


class SlotPool:
    def __init__(self, mem: DeviceMemory, sizes: dict[Key, int], num_layers: int, num_experts: int):
        self.mem, self.sizes = mem, sizes
        self.chunks: list[Chunk] = []
        self.where: dict[Key, tuple[Chunk, int]] = {}
        self._free: dict[int, int] = {}        # free slots per stride (a prefetch asks before each admission)
        # the table: the slot of each (layer, expert), -1 where it has none (a global slot id
        # = chunk index * 65536 + slot index; rebuilt when a trim moves chunks)
        self.table = np.full((num_layers, num_experts), -1, dtype=np.int32)

    # -- capacity ---------------------------------------------------------------------
    @property
    def allocated(self) -> int:
        return sum(c.storage.numel() for c in self.chunks)

    def free_slots(self, key: Key) -> int:
        return self._free.get(stride(self.sizes[key]), 0)

    def reserve(self, keys: list[Key], keep_free: int = 0) -> int:
        """Allocate the chunks that hold `keys` (on top of what is there); stops before a chunk
        that would leave under keep_free bytes on the card. Returns how many slots it made."""
        made = 0
        for s, count in class_counts(keys, self.sizes).items():
            for n in chunk_plan(count, s):
                if not self.add_chunk(n, s, keep_free):
                    return made + self._last_chunk(n - 1, s, keep_free)
                made += n
        return made

    def _last_chunk(self, most: int, slot_stride: int, keep_free: int) -> int:
        """The largest chunk of at most `most` slots that still fits; its slot count."""
        room = self.mem.snapshot().free_bytes - keep_free
        n = most
        while n > 0 and self.mem.cost(chunk_bytes(n, slot_stride)) > room:
            n -= 1
        return n if n and self.add_chunk(n, slot_stride, keep_free) else 0

    def add_chunk(self, slots: int, slot_stride: int, keep_free: int = 0) -> bool:
        nbytes = chunk_bytes(slots, slot_stride)
        if keep_free and self.mem.snapshot().free_bytes - self.mem.cost(nbytes) < keep_free:
            return False
        try:
            storage = self.mem.empty(LINE, (nbytes,), torch.uint8)
        except DeviceOutOfMemory:
            return False
        n = nbytes // slot_stride
        self.chunks.append(Chunk(storage, slot_stride, np.zeros(n, dtype=np.int8), [None] * n))
        self._free[slot_stride] = self._free.get(slot_stride, 0) + n
        return True

    # -- slots ------------------------------------------------------------------------
    def acquire(self, key: Key) -> torch.Tensor | None:
        """A free slot of key's class, marked LOADING; None when the class has none."""
        s = stride(self.sizes[key])
        if not self._free.get(s):
            return None
        for c in self.chunks:
            if c.slot_stride == s and c.free:
                self._free[s] -= 1
                i = c.take()
                c.states[i], c.keys[i] = LOADING, key
                self.where[key] = (c, i)
                self._mark(key)
                return c.view(i, self.sizes[key])
        return None

    def ready(self, key: Key) -> None:
        c, i = self.where[key]
        c.states[i] = RESIDENT

    def release(self, key: Key) -> None:
        c, i = self.where.pop(key)
        c.states[i], c.keys[i] = FREE, None
        c.give(i)
        self._free[c.slot_stride] += 1
        self.table[key] = -1

    def view(self, key: Key) -> torch.Tensor:
        c, i = self.where[key]
        return c.view(i, self.sizes[key])

    def state(self, key: Key) -> int:
        hit = self.where.get(key)
        return FREE if hit is None else int(hit[0].states[hit[1]])

    # -- giving memory back -----------------------------------------------------------
    def trim(self) -> tuple[int, list[tuple[Key, torch.Tensor]]]:
        """Free every chunk whose residents fit in the free slots of the fuller chunks of
        its class, moving them there first (a device-to-device copy). Returns the bytes
        freed and the moved (key, new view) pairs, so the caller can re-point its views."""
        moved, freed = [], 0
        for c in sorted(self.chunks, key=lambda c: c.used):
            others = [o for o in self.chunks if o is not c and o.slot_stride == c.slot_stride]
            if c.used > sum(o.slots - o.used for o in others):
                continue
            for i, key in enumerate(c.keys):
                if key is not None:
                    moved.append((key, self._move(key, c, i, others)))
            self.chunks.remove(c)
            self._free[c.slot_stride] -= len(c.free)
            self.mem.free(LINE, c.storage)
            freed += c.storage.numel()
        self._rebuild_table()
        return freed, moved

    def _move(self, key: Key, src: Chunk, i: int, others: list[Chunk]) -> torch.Tensor:
        state = src.states[i]
        dst = next(o for o in others if o.free)
        j = dst.take()
        nbytes = self.sizes[key]
        dst.view(j, nbytes).copy_(src.view(i, nbytes))
        dst.states[j], dst.keys[j] = state, key
        src.states[i], src.keys[i] = FREE, None
        src.give(i)
        self.where[key] = (dst, j)
        return dst.view(j, nbytes)

    def _mark(self, key: Key) -> None:
        c, i = self.where[key]
        self.table[key] = self.chunks.index(c) * 65536 + i

    def _rebuild_table(self) -> None:
        self.table.fill(-1)
        for key in self.where:
            self._mark(key)

"""The per-request VRAM guard and the elastic expert cache.

At the start of every request: if the device's free memory is under the floor
(--min-free-vram-mib), warn with the figures, count it, and give back the coldest
expert slots until the floor holds. Between requests, when memory has come back
(floor + margin), grow the cache back toward its planned size, hottest first.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field

from moefit.errors import DeviceOutOfMemory
from moefit.experts.cache import fill
from moefit.experts.slots import pool_bytes, stride
from moefit.memory.devices import MIB

log = logging.getLogger("moefit.guard")


@dataclass
class GuardEvent:
    time: float
    kind: str                     # warning | shrink | grow | oom
    message: str
    slots: int


@dataclass
class Guard:
    engine: object
    floor_bytes: int
    margin_bytes: int = 64 * MIB
    warnings: int = 0
    resizes: int = 0
    events: list[GuardEvent] = field(default_factory=list)

    @property
    def active(self) -> bool:
        return self.engine.loaded.plan is not None

    def _event(self, kind: str, message: str) -> None:
        self.events.append(GuardEvent(time.time(), kind, message, len(self.engine.runner.slots)))
        del self.events[:-200]
        (log.warning if kind in ("warning", "oom") else log.info)(message)

    def before_request(self) -> None:
        """Check the floor; shrink under it, grow back when memory returned."""
        if not self.active:
            return
        snap = self.engine.loaded.mem.snapshot()
        if snap.free_bytes < self.floor_bytes:
            self.warnings += 1
            holders = ", ".join(f"{p.name} {p.bytes / MIB:.0f} MiB" for p in
                                sorted(snap.processes, key=lambda p: -p.bytes)[:4])
            self._event("warning", f"only {snap.free_bytes / MIB:.0f} MiB of VRAM free at the start of this request "
                        f"(below {self.floor_bytes / MIB:.0f} MiB; held by {holders}); the driver may page device "
                        "memory to system RAM and decode collapses: giving back expert slots")
            self.shrink(self.floor_bytes - snap.free_bytes, "guard")
        elif snap.free_bytes > self._keep_free():
            self.grow(snap.free_bytes - self._keep_free())

    def _keep_free(self) -> int:
        """What growing must leave free: the floor plus the margin, and the reserve (free
        memory held back for the prompt path and the verify arena), whichever is more.
        A clean card has exactly the reserve free, so the margin is not added to it: that
        would ask for more than a clean card has, and the cache would never grow back."""
        reserve = self.engine.loaded.plan.reserve
        return max(self.floor_bytes + self.margin_bytes, reserve.total - reserve.draft)

    def target_budget(self) -> int:
        """How large the cache may grow: --expert-cache N's budget, or with auto every
        expert (a dirty start's small plan is not a ceiling once the culprit is gone)."""
        if self.engine.cfg.expert_cache != "auto":
            return self.engine.loaded.plan.cache_budget
        sizes = self.engine.runner.book.sizes
        return pool_bytes(list(sizes), sizes)       # every expert, as the pool allocates them

    def shrink(self, need_bytes: int, why: str) -> int:
        """Give back the coldest experts' pool chunks until need_bytes are freed (to the
        driver: the chunks are freed and the allocator's cache emptied); returns bytes freed."""
        runner, before = self.engine.runner, len(self.engine.runner.slots)
        freed = runner.give_back(need_bytes)
        runner.book.budget = runner.book.used
        if self.engine.graphs is not None:        # the recordings' pool goes too (recorded again as steps run)
            self.engine.graphs.forget()
        self.engine.loaded.mem.release_cached()
        if before != len(runner.slots) or freed:
            self.resizes += 1
            self._event("shrink", f"expert cache shrank ({why}): {before} -> {len(runner.slots)} experts, "
                        f"{freed / MIB:.1f} MiB given back")
        return freed

    def grow(self, room_bytes: int) -> None:
        """Load the hottest missing experts within room_bytes and the target budget: free
        slots first, then new chunks, each allocated only while the card keeps its floor."""
        runner, plan = self.engine.runner, self.engine.loaded.plan
        target = self.target_budget()
        chosen = fill(self._hottest_missing(), runner.book.sizes, max(0, min(target - runner.book.used, room_bytes)))
        free = Counter()
        for c in runner.pool.chunks:
            free[c.slot_stride] += c.slots - c.used
        needs_slot = []
        for key in chosen:
            s = stride(runner.book.sizes[key])
            if free[s]:
                free[s] -= 1
            else:
                needs_slot.append(key)
        runner.pool.reserve(needs_slot, keep_free=self._keep_free())
        before = len(runner.slots)
        for key in chosen:
            if runner.pool.free_slots(key):
                runner.load(key)
        runner.book.budget = max(runner.book.used, min(target, runner.book.used + room_bytes))
        if len(runner.slots) > before:
            self.resizes += 1
            self._event("grow", f"expert cache grew back: {before} -> {len(runner.slots)} experts "
                        f"(planned {plan.slots})")

    def _hottest_missing(self) -> list:
        runner = self.engine.runner
        missing = [k for k in runner.book.sizes if k not in runner.slots]
        usage, counts = runner.book.usage, runner.profile.counts
        return sorted(missing, key=lambda k: (-usage[k], -counts[k], k[1], k[0]))

    def after_oom(self, error: DeviceOutOfMemory) -> None:
        """A request hit out of memory: shrink so the floor holds again."""
        self._event("oom", f"out of memory mid-request ({error})")
        snap = self.engine.loaded.mem.snapshot()
        over = self._overcommit()
        self.shrink(max(over, self.floor_bytes - snap.free_bytes, 1), "out of memory")

    def _overcommit(self) -> int:
        """On a simulated card: bytes held beyond the card's total."""
        device = self.engine.loaded.mem.device
        if device.kind != "sim":
            return 0
        snap = device.sim.snapshot()
        held = sum(p.bytes for p in snap.processes) + snap.unattributed_bytes
        return max(0, held - snap.total_bytes)

"""Running a layer's routed experts: resident ones on the device from their cache slot,
misses on the host straight from the pack's map.

The host part is one native call per layer (kernels.moe_layer) for all its experts; in a prompt
chunk, an expert with rows enough runs as two fp32 GEMMs instead (Groups.busy, from the rows where
that pays on this machine: experts/host_rates.py), added after. The call is posted to the kernel
pool and the layer's bookkeeping (profile, cache counts, the next layer's prefetch) is done while
it runs (experts/host_side.py, `_account`). Where the
device's memory is host memory (cpu, a simulated card), resident experts go through that same
call, so the numbers do not depend on the cache size. On CUDA, the layer's routing and hidden
rows come to the host in one hand-off (experts/handoff.py) and the resident experts run on the
device from their pool slots while the host computes the misses; its sum goes back without a
wait. A decode step's resident experts are queued before the hand-off's wait, read through the
device's slot table (two launches: experts/device_side.py, Fused); other steps' after it, as the
host found them (a few launches: experts/grouped.py). Each side sums in fp32.

Legend: T tokens, E hidden, k top-k.
"""

from __future__ import annotations

import time
from array import array
from functools import partial

import torch

from moefit import kernels
from moefit.experts.cache import CacheBook, Key, Victims
from moefit.errors import DeviceOutOfMemory
from moefit.experts.costs import MissCosts
from moefit.experts import device_side, host_side
from moefit.experts.groups import Groups
from moefit.experts.handoff import Handoff
from moefit.experts.host_panels import HostPanels
from moefit.experts.host_rates import HostRates
from moefit.experts.host_table import HostTable
from moefit.experts.lookahead import LookAhead
from moefit.experts.pool import SlotPool
from moefit.experts.profile import Profile, dump_routing
from moefit.experts.slot_table import SlotTable
from moefit.experts.stager import STAGING_BYTES, Stager, Ticket
from moefit.pack.layout import matrix_quants
from moefit.pack.quant import LazyViews
from moefit.pack.reader import Pack
from moefit.runtime.placement import DeviceMemory


class ExpertRunner:
    def __init__(self, pack: Pack, mem: DeviceMemory, book: CacheBook, profile: Profile, pool: SlotPool,
                 host_dtype: torch.dtype = torch.float32):
        self.pack, self.mem, self.book, self.profile = pack, mem, book, profile
        self.host_dtype = host_dtype
        self.pool = pool
        self.slots: dict[Key, LazyViews] = {}   # a resident expert's part views into its pool slot
        self._host_parts: dict[Key, dict] = {}
        self.host = HostTable(self, pack.model.num_experts)   # the kernels' part addresses, where each expert is now
        self.panels = HostPanels()             # int4 experts kept in the kernel's panel order (the loader sets a budget)
        self._shapes: dict[str, tuple[int, int]] = {}
        self.dump = None                       # an open file: every token's routing as JSON lines
        self.ahead: LookAhead | None = None    # set by the loader when look-ahead is on
        self.handoff = Handoff()               # device <-> host synchronisations (DESIGN: handoffs_per_token)
        self.costs = MissCosts()               # PCIe or host for a multi-token step's misses (off until set)
        self.pcie_loads = 0                    # misses copied into the cache because that was cheaper
        self.arriving: dict[Key, Ticket] = {}   # prefetches in flight (experts/stager.py)
        self.stager: Stager | None = None      # made at the first prefetch
        self.wait_for_prefetch = True          # a layer waits for its prefetches' copies (the loader: not on CUDA)
        self._guess: tuple[int, torch.Tensor] | None = None   # the next layer's guess, for this layer's hand-off
        self._later: list = []                 # routing of layers run without a wait, for catch_up
        self.tokens = 0                        # token positions run through the MoE layers (engine.forward)
        self.rates = HostRates(self)           # the host's measured rates and GEMM crossovers (experts/host_rates.py)
        self.group = 1                         # resident experts multiplied at once (the plan's resident_group) ...
        self.slice_weights = 1 << 62           # ... in row slices of at most this many weights (its expert_slice)
        # a family whose experts are not plain SwiGLU (gpt-oss: biases, a clamped gate) gives its own
        # expert(layer, e, x, parts, quant) (the host's torch path), native_act(layer) (the native
        # calls', kernels.StepAct) and group_act(layer, expert_ids) (the device's grouped path)
        self.expert_fn = None
        self.native_act = None                 # ... and, where the native call can run it, its activation,
        self.group_act = None                  # ... and for a group on the device (experts/grouped.py GroupAct)
        self.table: SlotTable | None = None    # the slots' addresses on the device (set by the loader)
        self.fused = device_side.Fused(self)   # the slot-table kernels, where they take a step

    @property
    def look_ahead(self) -> bool:
        return self.ahead is not None

    def expect(self, layer: int, ids: torch.Tensor, now_routes: bool = True) -> None:
        """The next MoE layer's ranked guess [T, 2k]: it comes to the host with the hand-off of the
        layer computing now, and its experts are brought in once that layer has routed (prefetch,
        from run), so that none it uses is evicted; or at once, with a wait of its own, when that
        layer is dense (`now_routes` False)."""
        if now_routes:                          # carried by the hand-off of the layer computing now
            self._guess = (layer, ids)
            return
        self.ahead.expect(layer, self.handoff.fetch(ids).tolist())
        self.prefetch(layer, layer - 1, [])

    def prefetch(self, layer: int, now: int, busy: list[int]) -> None:
        """Bring `layer`'s guessed experts that are missing into the cache, most likely first (at
        most the budget), in place of the coldest slots neither the layer computing now (`busy`:
        what layer `now` routed to) nor layer's own prediction needs; ask for the pages of the
        other missing ones, which the host will compute from the pack's map. Measured on the
        demo's traces (bench/cache_policy.py): keeping only these, rather than every guessed
        rank of both layers, is what lets look-ahead reach Belady's MIN at 15 % of the experts."""
        order = self.ahead.predicted.get(layer)
        if not order:
            return
        budget = self.ahead.pcie_budget(self.costs.pcie_bytes_per_s, self.book.sizes[(layer, order[0])],
                                        time.perf_counter())                # also times the layer: every call
        if self.stager is not None:            # a worker behind by a layer's copies is sent no more
            budget = max(0, budget - self.stager.backlog)
        missing = [e for e in order if (layer, e) not in self.slots and (layer, e) not in self.arriving]
        if not missing:
            return
        victims = Victims(self.book, self.ahead.wanted(layer, now, busy), self.arriving, min(budget, len(missing)))
        read_ahead = []
        with self.staging().together():                   # the copies, then the read-aheads: one wake-up
            for n, e in enumerate(missing):
                if n < budget and self._make_room((layer, e), victims):
                    self._send((layer, e))
                else:
                    read_ahead.append(e)
            if read_ahead:
                self.staging().call(partial(self.pack.warm, layer, read_ahead))

    def _send(self, key: Key) -> None:
        """The blob goes into a free slot off the engine thread (experts/stager.py) while the
        current layer computes; the slot stays LOADING until the layer that uses it orders the
        copy first (`_arrived`: on CUDA the compute stream waits for it, no host wait)."""
        view = self.pool.acquire(key)
        if view is None:
            return
        self.arriving[key] = self.staging().send(key, partial(self.pack.blob, *key), view)   # viewed there
        self.book.admit(key)
        self.book.swaps += 1
        self.ahead.fetched_for(*key)

    def staging(self) -> Stager:
        """The engine's worker (experts/stager.py): the look-ahead's copies and read-aheads, the
        host panels' copies; made at its first job."""
        if self.stager is None:
            largest = max(self.book.sizes.values())
            self.stager = Stager(self.mem.torch_device, largest, max(2, min(4, STAGING_BYTES // largest)))
        return self.stager

    def _arrived(self, layer: int | None = None, wait: bool = True) -> None:
        """This layer's prefetches (or all): their copies are ordered first (on CUDA the compute
        stream waits for them, no host wait), and their slots become resident. Without `wait`,
        only those the worker has issued: a later one is a miss this step, computed on the host
        while its copy goes on (LookAhead.prefetch_late), rather than a wait for the worker."""
        for key in [k for k in self.arriving if layer is None or k[0] == layer]:
            if not wait and not self.arriving[key].issued.is_set():
                continue
            self.stager.landed(ticket := self.arriving.pop(key))
            self.pool.ready(key)
            self._placed(key, ticket.slot)

    def settle(self) -> None:
        """Every prefetch in flight resident and every layer's routing counted (a request's end:
        the cache's count is its experts, its hit counts are the request's)."""
        self.catch_up()
        if self.arriving:
            self._arrived()

    def _make_room(self, key: Key, victims: Victims) -> bool:
        """A free slot of key's size class: there is one, or the coldest resident of that
        class that `victims` allows is evicted for it; False when every one is kept."""
        if self.pool.free_slots(key):
            return True
        victim = victims.pop(self.book.sizes[key])
        if victim is not None:
            self.unload(victim)
        return victim is not None

    # -- placement ---------------------------------------------------------------
    def load(self, key: Key) -> None:
        """Copy an expert into a free slot of the pool (DeviceOutOfMemory when its class has none)."""
        view = self.pool.acquire(key)
        if view is None:
            raise DeviceOutOfMemory(f"no free expert slot of {self.book.sizes[key]} bytes")
        view.copy_(self.pack.blob(*key), non_blocking=True)
        self.pool.ready(key)
        self._placed(key, view)
        self.book.admit(key)

    def _placed(self, key: Key, view: torch.Tensor) -> None:
        """key's blob is resident in `view`: its part views, and the device table's address."""
        self.host.forget(key)
        self.slots[key] = LazyViews(view, self.pack.layouts[self.pack.blobs[key].quant])
        if self.table is not None:
            self.table.place(key, view)

    def unload(self, key: Key) -> None:
        if key in self.arriving:               # a prefetch in flight into this slot: let it land first
            self.stager.landed(self.arriving.pop(key))
        self.host.forget(key)
        self.slots.pop(key, None)
        if self.table is not None:
            self.table.drop(key)
        self.pool.release(key)
        self.book.evict(key)

    def swap(self, evict: Key, admit: Key) -> None:
        self.unload(evict)
        self.load(admit)
        self.book.swaps += 1

    def give_back(self, need_bytes: int) -> int:
        """Evict the coldest experts until chunks holding need_bytes are freed (residents of a
        chunk that can go move to free slots elsewhere); returns the bytes freed."""
        freed = self._trim()
        for key in self.book.coldest():
            if freed >= need_bytes:
                break
            self.unload(key)
            freed += self._trim()
        return freed

    def _trim(self) -> int:
        self._arrived()                        # no slot moves while a copy into it is in flight
        freed, moved = self.pool.trim()
        for key, view in moved:
            self._placed(key, view)
        return freed

    # -- compute -----------------------------------------------------------------
    def run_routed(self, layer: int, x: torch.Tensor, router: kernels.Router) -> torch.Tensor | None:
        """run, for a decode step on host memory routed and posted in one native call
        (host_side.route_step); None where that does not apply (nothing done)."""
        routed = host_side.route_step(self, layer, x, router) if x.device.type == "cpu" else None
        if routed is None:
            return None
        work, ids, weights = routed
        return self.run(layer, x, ids, weights, (work is not None, work))

    def run(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
            posted: tuple | None = None) -> torch.Tensor:
        """Sum over each token's top-k experts of weight * expert(x): [T, E]. `posted`: a decode
        step's host work, posted with its routing (run_routed), as _post_step gives it."""
        shape = self.fused.shape(layer, x)
        if shape is not None and self.arriving:
            self._arrived(layer, self.wait_for_prefetch)           # the table's row holds them
        guess, self._guess = self._guess, None
        if shape is not None and self.fused.may_defer(layer):
            out = self.fused.all_resident(layer, x, ids, weights, shape, guess)
            if out is not None:
                return out
        self.catch_up()
        sent = self.handoff.send(x, ids, weights, guess[1] if guess else None)
        early = self.fused.queue(layer, x, ids, weights, shape) if shape is not None else None  # before the wait
        xh, ids_h, w_h, *guessed = self.handoff.wait(sent)         # the layer's one synchronisation
        routed = ids_h.tolist()                                     # the bookkeeping's one conversion
        on_host = early is None and x.device.type == "cpu"   # slots and the pack's map are both host memory: one call
        posted, host = posted or (self._post_step(layer, x, xh, ids_h, w_h, routed[0], early, on_host)
                                  if x.shape[0] == 1 else (False, None))
        if self.arriving:                                           # a decode step's: while its call runs
            self._arrived(layer, self.wait_for_prefetch)
        groups = Groups.of(ids_h, w_h, routed)
        late = [e for e in groups.experts if (layer, e) in self.arriving] if self.arriving else []
        hits = [bool(early[1][e]) if early else (layer, e) in self.slots for e in groups.experts]
        resident = hits
        if early is None and x.shape[0] > 1 and self.costs.enabled:
            resident = self._copy_cheap_misses(layer, x.shape[0], groups, hits)
        if on_host:
            host = host if posted else host_side.start(self, layer, x, groups)
            self._account(layer, routed, w_h, groups, hits, late, guess, guessed)    # while the host computes
            return host.result()
        if not posted:
            misses = groups.subset([not r for r in resident])
            host = host_side.start(self, layer, xh.float(), misses) if misses.experts else None
        out = early[0] if early else self._device_experts(layer, x, groups.subset(resident))  # queued on the device ...
        self._account(layer, routed, w_h, groups, hits, late, guess, guessed)   # ... while the host computes the misses
        if host is not None:
            out = out + self.handoff.to_device(host.result(), out)
        return out.to(x.dtype)

    def _post_step(self, layer: int, x: torch.Tensor, xh: torch.Tensor, ids_h: torch.Tensor, w_h: torch.Tensor,
                   experts: list[int], early, on_host: bool) -> tuple[bool, host_side.HostWork | None]:
        """A decode step's host experts posted as soon as its routing is here, before the arrivals
        and the grouping (experts/host_side.py step): every expert where the card's memory is host
        memory, else those the device's table did not hold when the resident ones were queued
        (`early`; an expert that lands meanwhile was queued as a miss). (posted, its work; None
        for no misses); posted False where `start` must do it after the grouping."""
        if early is None:                        # not on host memory: the grouped device path, after the arrivals
            work = host_side.step(self, layer, x, ids_h, w_h, experts) if on_host else None
            return work is not None, work
        miss = [i for i, e in enumerate(experts) if not early[1][e]]
        if not miss:
            return True, None
        w = w_h.reshape(-1).tolist()
        work = host_side.step(self, layer, xh.float(), array("q", [experts[i] for i in miss]),
                              array("f", [w[i] for i in miss]), [experts[i] for i in miss])
        return work is not None, work

    def _account(self, layer: int, routed: list[list[int]], w_h: torch.Tensor, groups: Groups, hits: list[bool],
                 late: list[int], guess, guessed: list) -> None:
        """A layer's bookkeeping, once its routing is on the host and its experts are computing:
        the next layer's guess, the profile (and the routing dump), the look-ahead's score, the
        cache's counts, and the next layer's prefetch."""
        if guess:
            self.ahead.expect(guess[0], guessed[0].tolist())
        self.profile.record(layer, routed)
        if self.dump is not None:
            guesses = self.ahead.per_token.get(layer) if self.ahead is not None else None
            dump_routing(self.dump, layer, routed, w_h.float().tolist(), guesses)
        if self.ahead is not None:
            self.ahead.score(layer, groups.experts, routed[-1], late)
        self.book.record(layer, groups.experts, hits)
        if self.ahead is not None:                                # the next layer's guess, brought in
            self.prefetch(self.ahead.next_guessed(layer), layer, groups.experts)

    def defer(self, layer: int, guess, sent) -> None:
        self._later.append((layer, guess, sent))

    def catch_up(self) -> None:
        """The bookkeeping of the layers that ran without a wait, in their order: one wait for all."""
        if not self._later:
            return
        later, self._later = self._later, []
        self.handoff.wait(later[-1][2])                         # the last copy's event: all of them are here
        for layer, guess, ((ids_h, w_h, *guessed), _) in later:
            if guess:
                self.ahead.expect(guess[0], guessed[0].tolist())
            routed = ids_h.tolist()
            self.profile.record(layer, routed)
            groups = Groups.of(ids_h, w_h, routed)
            if self.ahead is not None:
                self.ahead.score(layer, groups.experts, routed[-1])
            self.book.record(layer, groups.experts, [True] * len(groups.experts))

    def run_on_host(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """A layer whose experts are not the cache's (an MTP layer's): all on the host, from the
        pack's map, through the same hand-off; not counted in the hit rates or the profile."""
        xh, ids_h, w_h = self.handoff.to_host(x, ids, weights)
        out = self._host_experts(layer, xh.float() if x.device.type != "cpu" else x, Groups.of(ids_h, w_h))
        return out if x.device.type == "cpu" else self.handoff.to_device(out, x)

    def _copy_cheap_misses(self, layer: int, tokens: int, groups: "Groups", resident: list[bool]) -> list[bool]:
        """Admit the misses that are cheaper to copy over PCIe than to compute on the host
        (experts/costs.py), into free slots or in place of cold ones this step does not use."""
        quant = self.pack.blobs[(layer, groups.experts[0])].quant
        inter, _ = self._shape(quant)
        macs = 3 * inter * self.pack.model.hidden_size
        victims = Victims(self.book, {(layer, e) for e in groups.experts}, self.arriving, resident.count(False))
        gemm = self.rates.busy(layer, quant, groups, tokens)  # the host would run these as GEMMs
        out = list(resident)
        for i, e in enumerate(groups.experts):
            key, rows = (layer, e), groups.start[i + 1] - groups.start[i]
            if out[i] or not self.costs.copy_is_cheaper(self.book.sizes[key], rows, macs, gemm[i]):
                continue
            if self._make_room(key, victims):
                self.load(key)
                self.pcie_loads += 1
                out[i] = True
        return out

    @property
    def handoffs(self) -> int:
        return self.handoff.syncs

    def _host_experts(self, layer: int, x: torch.Tensor, groups: "Groups", busy: list[bool] | None = None) -> torch.Tensor:
        """The experts of `groups` on host memory, computed now (experts/host_side.py)."""
        return host_side.start(self, layer, x, groups, busy).result()

    def _device_experts(self, layer: int, x: torch.Tensor, groups: "Groups") -> torch.Tensor:
        """Resident experts on the device from their pool slots, as the host chose them
        (experts/device_side.py)."""
        return device_side.grouped(self, layer, x, groups)

    def _shape(self, quant: str) -> tuple[int, int]:
        """(intermediate size, int4 group size or 0) of this quant's blobs, from the layout."""
        if quant not in self._shapes:
            parts = {p.name: p for p in self.pack.layouts[quant]}
            inter = parts["gate_up"].shape[0] // 2
            gate_up, down = matrix_quants(quant)
            group = (self.pack.model.hidden_size // parts["gate_up.scale"].shape[1] if gate_up in kernels.GROUPED
                     else inter // parts["down.scale"].shape[1] if down in kernels.GROUPED else 0)
            self._shapes[quant] = (inter, group)
        return self._shapes[quant]

    def _pointers(self, layer: int, experts: list[int]) -> list[int]:
        """The part addresses of each expert in host memory (_on_host), flat in expert order."""
        return self.host.pointers(layer, experts)

    def _on_host(self, layer: int, e: int) -> tuple[dict, str]:
        """An expert's parts in host memory, for the host's kernels, and the quant they are stored
        in: its slot where the card's memory is host memory (cpu, a simulated card), else the
        pack's map, or the copy in panel order made from it (experts/host_panels.py). A CUDA slot
        is never handed to them (the start's host measurements time experts that may be resident:
        their device addresses would be read on the host)."""
        key = (layer, e)
        slot, quant = self.slots.get(key), self.pack.blobs[key].quant
        if slot is not None and slot.device.type == "cpu":
            return slot, quant
        parts = self._host_parts.get(key)
        if parts is None:
            parts = self._host_parts[key] = self.pack.expert_parts(layer, e)
        panels = self.panels.parts(key, parts, quant)
        return (parts, quant) if panels is None else (panels, "int4p")

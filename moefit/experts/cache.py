"""The expert cache's bookkeeping: which experts are resident, the byte budget, hit and
miss counters, and the adaptive tier's swap decisions. No torch: the runner applies
the decisions to device tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

Key = tuple[int, int]                 # (layer, expert)


def fill(order: list[Key], sizes: dict[Key, int], budget: int) -> list[Key]:
    """Hottest first until the budget is full; a blob that does not fit is skipped so
    smaller (more compressed) blobs further down can still use the space."""
    chosen, used = [], 0
    for key in order:
        if used + sizes[key] <= budget:
            chosen.append(key)
            used += sizes[key]
    return chosen


@dataclass
class SwapPolicy:
    period: int = 32          # decode steps between rounds
    decay: float = 0.95       # usage decay per round
    max_swaps: int = 4        # per round; 0 = static placement
    margin: float = 1.25      # a candidate must beat the coldest resident by this factor


@dataclass
class CacheBook:
    """Residency and statistics. `budget` may shrink (guard) and grow back."""

    sizes: dict[Key, int]
    num_layers: int
    num_experts: int
    budget: int
    policy: SwapPolicy = field(default_factory=SwapPolicy)
    resident: dict[Key, int] = field(default_factory=dict)
    hits: np.ndarray = None
    misses: np.ndarray = None
    swaps: int = 0
    bytes_moved: int = 0
    steps: int = 0

    def __post_init__(self):
        shape = (self.num_layers, self.num_experts)
        self.hits = np.zeros(self.num_layers, dtype=np.int64)
        self.misses = np.zeros(self.num_layers, dtype=np.int64)
        self._usage = np.zeros(shape, dtype=np.float64)
        self._sizes_held = np.zeros(shape, dtype=np.int64)     # a resident's blob bytes, 0 elsewhere
        # per size class, each expert's usage where it is a resident of that size, else inf, flat in
        # coldest()'s order of ties (_flat): a prefetch's victims are its first minima (coldest_of_size)
        self._cold: dict[int, np.ndarray] = {}
        for key, nbytes in self.resident.items():
            self._sizes_held[key] = nbytes
            self._cold_of(nbytes)[self._flat(key)] = 0.0

    @property
    def usage(self) -> np.ndarray:
        """Each expert's decayed use count [layers, experts], read-only: set_usage writes it, so that
        the victims' index follows."""
        view = self._usage.view()
        view.flags.writeable = False
        return view

    def set_usage(self, usage) -> None:
        self._usage[...] = usage
        for size, cold in self._cold.items():
            cold[...] = np.where(self._sizes_held == size, self._usage, np.inf).T[::-1, ::-1].ravel()

    @property
    def used(self) -> int:
        return sum(self.resident.values())

    def admit(self, key: Key) -> None:
        self.resident[key] = self._sizes_held[key] = self.sizes[key]
        self._cold_of(self.sizes[key])[self._flat(key)] = self._usage[key]
        self.bytes_moved += self.sizes[key]

    def evict(self, key: Key) -> None:
        del self.resident[key]
        self._cold[int(self._sizes_held[key])][self._flat(key)] = np.inf
        self._sizes_held[key] = 0

    def is_resident(self, key: Key) -> bool:
        return key in self.resident

    def record(self, layer: int, experts: list[int], resident: list[bool]) -> None:
        """One layer's routed experts for one forward (each distinct expert once)."""
        hit = sum(resident)
        self.hits[layer] += hit
        self.misses[layer] += len(resident) - hit
        usage, held = self._usage[layer], self._sizes_held[layer]
        for e in experts:                       # distinct, a few: a loop is cheaper than an index array
            usage[e] += 1
            if held[e]:
                self._cold[int(held[e])][self._flat((layer, e))] = usage[e]

    def hit_rate(self) -> float:
        total = self.hits.sum() + self.misses.sum()
        return float(self.hits.sum() / total) if total else 0.0

    def layer_hit_rates(self) -> list[float]:
        total = self.hits + self.misses
        return [float(h / t) if t else 0.0 for h, t in zip(self.hits, total)]

    def coldest(self) -> list[Key]:
        return sorted(self.resident, key=lambda k: (self._usage[k], -k[1], -k[0]))

    def coldest_of_size(self, size: int, skip, n: int = 1) -> list[Key]:
        """coldest()'s first n residents of `size` bytes not in `skip` (fewer where there are
        fewer), without sorting them all: the first minima of the size class's index, those `skip`
        holds set aside on the way (few: it holds what is in use or foreseen). A prefetch asks for
        its victims right after the host's expert call has streamed its weights through the caches:
        the sort this replaced took 200-320 us there at 48 layers; this takes ~8 us warm."""
        cold = self._cold.get(size)
        if cold is None:
            return []
        picks, hidden = [], []                  # hidden: minima that `skip` keeps, few (used or foreseen)
        while len(picks) < n:
            i = int(cold.argmin())
            if cold[i] == np.inf:
                break
            (hidden if self._key_of(i) in skip else picks).append((i, cold[i]))
            cold[i] = np.inf
        for i, value in picks + hidden:
            cold[i] = value
        return [self._key_of(i) for i, _ in picks]

    def _cold_of(self, size: int) -> np.ndarray:
        if size not in self._cold:
            self._cold[size] = np.full(self.num_layers * self.num_experts, np.inf)
        return self._cold[size]

    def _flat(self, key: Key) -> int:
        """key's place in the victims' index: coldest()'s ties go to the highest expert id, then layer."""
        return (self.num_experts - 1 - key[1]) * self.num_layers + self.num_layers - 1 - key[0]

    def _key_of(self, i: int) -> Key:
        e, layer = divmod(i, self.num_layers)
        return (self.num_layers - 1 - layer, self.num_experts - 1 - e)

    def shrink_to(self, budget: int) -> list[Key]:
        """Lower the budget; the coldest residents to give back so `used` fits it."""
        self.budget = budget
        evicted, used = [], self.used
        for key in self.coldest():
            if used <= budget:
                break
            evicted.append(key)
            used -= self.resident[key]
        return evicted

    def swap_round(self) -> list[tuple[Key, Key]]:
        """(evict, admit) pairs: non-resident experts whose decayed usage beats the
        coldest resident of the same blob size by the policy's margin."""
        self._usage *= self.policy.decay
        for cold in self._cold.values():
            cold *= self.policy.decay
        if self.policy.max_swaps <= 0 or not self.resident:
            return []
        hot = np.argsort(-self._usage, axis=None)
        cold = self.coldest()
        pairs, cold_i = [], 0
        for flat in hot[: 4 * self.policy.max_swaps + len(self.resident)]:
            key = (int(flat // self.num_experts), int(flat % self.num_experts))
            if key in self.resident or key not in self.sizes:
                continue
            while cold_i < len(cold) and self.sizes[cold[cold_i]] != self.sizes[key]:
                cold_i += 1
            if cold_i >= len(cold) or self._usage[key] <= self.policy.margin * self._usage[cold[cold_i]] + 1e-9:
                break
            pairs.append((cold[cold_i], key))
            cold_i += 1
            if len(pairs) >= self.policy.max_swaps:
                break
        return pairs


class Victims:
    """Eviction candidates for a run of admissions (a prefetch's, a step's cheap copies): the
    coldest residents of each size class not in `keep` nor `arriving` (a copy is writing their
    slot), at most n, found once for them all rather than once an admission."""

    def __init__(self, book: CacheBook, keep: set, arriving: dict, n: int):
        self.book, self.keep, self.arriving, self.n = book, keep, arriving, max(n, 1)
        self._found: dict[int, list[Key]] = {}

    def pop(self, size: int) -> Key | None:
        found = self._found.get(size)
        if found is None:
            found = self._found[size] = self.book.coldest_of_size(size, self.keep | self.arriving.keys(), self.n)
        return found.pop(0) if found else None

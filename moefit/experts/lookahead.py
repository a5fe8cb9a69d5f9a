"""Look-ahead: which experts will the next MoE layer route to?

The hidden state after layer l's attention, put through layer l+1's own norm and router,
predicts layer l+1's routing (no training: published figures give 90-97 % recall on
Qwen3-30B and Mixtral). Each token's guess ranks 2k experts: its first k are the prediction,
scored against the routing that follows (recall per layer); on a device with an expert cache
the guessed experts that are not resident are brought in ahead of use, most likely first (the
first k of every token, then the next ranks), at most `budget` per layer and no more than PCIe
moves in one layer's time (pcie_budget), once the layer computing now has routed, in place of
the coldest slots neither that layer's experts nor the prediction need (wanted). A prefetched
expert the layer then uses is a hit (it is resident when the layer runs) and a prefetch hit.
No torch: the runner applies the moves.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class LookAhead:
    num_layers: int
    budget: int                                     # experts a layer may bring in ahead (0: predict only)
    top_k: int = 0                                  # the ranks that are the prediction (0: all)
    probe_layers: list[int] = field(default_factory=list)    # layers guessed by a trained probe (experts/probe.py)
    predicted: dict[int, list[int]] = field(default_factory=dict)   # layer -> experts, most confident first
    per_token: dict[int, list[list[int]]] = field(default_factory=dict)  # layer -> each token's top-k guess
    fetched: dict[int, set[int]] = field(default_factory=dict)      # layer -> brought in, not yet used
    foreseen: dict[int, set[int]] = field(default_factory=dict)     # layer -> every token's first k
    guessed: np.ndarray = None                      # [L] routed experts that were predicted
    routed: np.ndarray = None                       # [L] routed experts (distinct per forward)
    prefetched: int = 0
    prefetch_hits: int = 0
    layer_seconds: float = 0.0                      # a layer's time, smoothed (between two predictions)
    _last_call: float | None = None

    def __post_init__(self):
        self.guessed = np.zeros(self.num_layers, dtype=np.int64)
        self.routed = np.zeros(self.num_layers, dtype=np.int64)

    def expect(self, layer: int, per_token: list[list[int]]) -> list[int]:
        """Record each token's ranked guess for `layer`; returns the union, rank by rank (every
        token's first choice, then every second choice, ...)."""
        self.per_token[layer] = per_token
        order = list(dict.fromkeys(e for rank in zip(*per_token) for e in rank))
        self.predicted[layer] = order
        self.foreseen[layer] = {e for guess in per_token for e in guess[:self.top_k or None]}
        return order

    def pcie_budget(self, pcie_bytes_per_s: float, blob_bytes: int, now: float) -> int:
        """Experts one layer's time lets PCIe bring in, at most `budget`: the layer time is
        the smoothed interval between predictions (one per layer); with no PCIe rate (a simulated
        card, unless given) the budget is the flag's."""
        if self._last_call is not None and 0 < now - self._last_call < 1.0:
            gap = now - self._last_call
            self.layer_seconds = gap if not self.layer_seconds else 0.9 * self.layer_seconds + 0.1 * gap
        self._last_call = now
        if pcie_bytes_per_s <= 0 or not self.layer_seconds:
            return self.budget
        return min(self.budget, int(pcie_bytes_per_s * self.layer_seconds / blob_bytes))

    def wanted(self, layer: int, now: int, busy: list[int]) -> set[tuple[int, int]]:
        """(layer, expert) keys a prefetch for `layer` must not evict: what the layer computing
        now routed to, and what `layer` is predicted to use (every token's first k)."""
        return {(now, e) for e in busy} | {(layer, e) for e in self.foreseen.get(layer, ())}

    def next_guessed(self, layer: int) -> int:
        """The first layer after `layer` with a guess waiting (-1: none)."""
        return min((l for l in self.predicted if l > layer), default=-1)

    def fetched_for(self, layer: int, expert: int) -> None:
        self.fetched.setdefault(layer, set()).add(expert)
        self.prefetched += 1

    def score(self, layer: int, experts: list[int]) -> None:
        """The layer has routed to `experts` (distinct): count what was foreseen."""
        self.predicted.pop(layer, None)
        self.per_token.pop(layer, None)
        guess = self.foreseen.pop(layer, None)
        if guess is None:
            return
        routed = set(experts)
        self.guessed[layer] += len(routed & guess)
        self.routed[layer] += len(routed)
        self.prefetch_hits += len(routed & self.fetched.pop(layer, set()))

    def recall(self) -> float:
        total = self.routed.sum()
        return float(self.guessed.sum() / total) if total else 0.0

    def layer_recall(self) -> list[float | None]:
        return [float(g / r) if r else None for g, r in zip(self.guessed, self.routed)]

    def to_json(self) -> dict:
        return {"prefetched": self.prefetched, "prefetch_hits": self.prefetch_hits,
                "prediction_recall": self.recall(), "layer_prediction_recall": self.layer_recall(),
                "prefetch_per_layer": self.budget, "layer_ms": 1e3 * self.layer_seconds,
                "predictor": f"probe on {len(self.probe_layers)} layers" if self.probe_layers else "router"}

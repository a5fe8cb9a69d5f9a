"""Look-ahead: which experts will the next MoE layer route to?

The hidden state after layer l's attention, put through layer l+1's own norm and router,
predicts layer l+1's routing (no training: published figures give 90-97 % recall on
Qwen3-30B and Mixtral; a trained probe, experts/probe.py, does better). Each token's guess ranks
2k experts: its first k are the prediction, scored against the routing that follows (recall per
layer). On a device with an expert cache the guessed experts that are not resident are brought
in ahead of use, most likely first: the first k of every token, then what the layer routed the
previous token to (recency: consecutive tokens share experts), then the guess's next ranks; at
most `budget` per layer and no more than PCIe moves in one layer's time (pcie_budget), once the
layer computing now has routed, in place of the coldest slots that neither that layer's experts,
the prediction nor the layer's previous routing needs (wanted). The first MoE layer has no layer
before it to guess from: once the last MoE layer has routed, its previous routing is brought in
for the next forward (while the lm_head and the sampler run). A prefetched expert the layer then
uses is a hit (it is resident when the layer runs) and a prefetch hit. Measured on the demo's
and a random fixture's traces (bench/cache_policy.py). No torch: the runner applies the moves.
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
    moe_layers: list[int] = field(default_factory=list)      # the first is guessed from its own previous routing
    recent: dict[int, list[int]] = field(default_factory=dict)      # layer -> what the last token routed to
    predicted: dict[int, list[int]] = field(default_factory=dict)   # layer -> experts, most confident first
    per_token: dict[int, list[list[int]]] = field(default_factory=dict)  # layer -> each token's top-k guess
    fetched: dict[int, set[int]] = field(default_factory=dict)      # layer -> brought in, not yet used
    foreseen: dict[int, set[int]] = field(default_factory=dict)     # layer -> every token's first k
    guessed: np.ndarray = None                      # [L] routed experts that were predicted
    routed: np.ndarray = None                       # [L] routed experts (distinct per forward)
    prefetched: int = 0
    prefetch_hits: int = 0
    prefetch_late: int = 0                          # routed to while its copy was still on its way (a miss)
    layer_seconds: float = 0.0                      # a layer's time, smoothed (between two predictions)
    _last_call: float | None = None

    def __post_init__(self):
        self.guessed = np.zeros(self.num_layers, dtype=np.int64)
        self.routed = np.zeros(self.num_layers, dtype=np.int64)

    def expect(self, layer: int, per_token: list[list[int]]) -> list[int]:
        """Record each token's ranked guess for `layer`; returns the union, rank by rank (every
        token's first choice, then every second choice, ...)."""
        self.per_token[layer] = per_token
        ranks = list(zip(*per_token))
        first, rest = ranks[:self.top_k or len(ranks)], ranks[self.top_k or len(ranks):]
        order = list(dict.fromkeys([e for rank in first for e in rank] + self.recent.get(layer, [])
                                   + [e for rank in rest for e in rank]))
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
        now routed to, what `layer` is predicted to use (every token's first k) and what it
        routed the previous token to."""
        mine = self.foreseen.get(layer, set()) | set(self.recent.get(layer, ()))
        return {(now, e) for e in busy} | {(layer, e) for e in mine}

    def next_guessed(self, layer: int) -> int:
        """The first layer after `layer` with a guess waiting; after the last MoE layer, the
        first one, guessed for the next forward as its previous routing (-1: none)."""
        after = min((l for l in self.predicted if l > layer), default=-1)
        if after < 0 and self.moe_layers and layer == self.moe_layers[-1] and self.recent.get(self.moe_layers[0]):
            after = self.moe_layers[0]
            self.predicted[after] = list(self.recent[after])
        return after

    def fetched_for(self, layer: int, expert: int) -> None:
        self.fetched.setdefault(layer, set()).add(expert)
        self.prefetched += 1

    def score(self, layer: int, experts: list[int], last_token: list[int], late: list[int] = ()) -> None:
        """The layer has routed to `experts` (distinct), its last token to `last_token`: count
        what was foreseen and what arrived in time (not `late`: brought in, still on its way),
        and remember the last token's routing."""
        self.predicted.pop(layer, None)
        self.per_token.pop(layer, None)
        self.recent[layer] = list(dict.fromkeys(last_token))
        routed = set(experts)
        self.prefetch_hits += len(routed & self.fetched.pop(layer, set()) - set(late))
        self.prefetch_late += len(late)
        guess = self.foreseen.pop(layer, None)
        if guess is None:
            return
        self.guessed[layer] += len(routed & guess)
        self.routed[layer] += len(routed)

    def recall(self) -> float:
        total = self.routed.sum()
        return float(self.guessed.sum() / total) if total else 0.0

    def layer_recall(self) -> list[float | None]:
        return [float(g / r) if r else None for g, r in zip(self.guessed, self.routed)]

    def to_json(self) -> dict:
        return {"prefetched": self.prefetched, "prefetch_hits": self.prefetch_hits,
                "prefetch_late": self.prefetch_late,
                "prediction_recall": self.recall(), "layer_prediction_recall": self.layer_recall(),
                "prefetch_per_layer": self.budget, "layer_ms": 1e3 * self.layer_seconds,
                "predictor": f"probe on {len(self.probe_layers)} layers" if self.probe_layers else "router"}

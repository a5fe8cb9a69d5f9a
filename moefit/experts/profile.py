"""Expert hotness: routing counts per (layer, expert). No torch.

Recorded by `moefit profile` from real prompts and learned live by the engine; saved
in the pack as profile.json with an atomic write.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np


FOLD_AT = 1 << 14                                 # routings held in a list before they are added up


class Profile:
    def __init__(self, counts: np.ndarray):
        self._counts = counts                     # [L, N] int64, all layers (dense rows stay 0)
        self._layers: list[int] = []              # a decode step's routings, not yet in _counts ...
        self._experts: list[int] = []             # ... (record: a list's append, ~0 against numpy's scalars)

    @property
    def counts(self) -> np.ndarray:
        self._fold()
        return self._counts

    @counts.setter
    def counts(self, counts: np.ndarray) -> None:
        self._counts, self._layers, self._experts = counts, [], []

    @staticmethod
    def empty(num_layers: int, num_experts: int) -> "Profile":
        return Profile(np.zeros((num_layers, num_experts), dtype=np.int64))

    @staticmethod
    def load(path: Path, num_layers: int, num_experts: int) -> "Profile":
        """The saved profile, or an empty one when there is none or it does not match."""
        try:
            counts = np.array(json.loads(Path(path).read_text())["counts"], dtype=np.int64)
        except (OSError, ValueError, KeyError, TypeError):
            return Profile.empty(num_layers, num_experts)
        if counts.shape != (num_layers, num_experts):
            return Profile.empty(num_layers, num_experts)
        return Profile(counts)

    def save(self, path: Path) -> None:
        path = Path(path)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"counts": self.counts.tolist()}))
        os.replace(tmp, path)

    def record(self, layer: int, rows: list[list[int]]) -> None:
        """One layer's routing of some tokens (each token's expert ids). A decode step's few are
        held in lists and added up when counts is read: right after the host's expert call,
        eight numpy scalar additions took 25-30 us of the engine thread, its caches cold."""
        if len(rows) > 2:
            np.add.at(self.counts[layer], np.asarray(rows).reshape(-1), 1)
            return
        for row in rows:
            self._experts += row
            self._layers += [layer] * len(row)
        if len(self._layers) > FOLD_AT:
            self._fold()

    def _fold(self) -> None:
        if self._layers:
            np.add.at(self._counts, (self._layers, self._experts), 1)
            self._layers, self._experts = [], []

    @property
    def is_empty(self) -> bool:
        return not self.counts.any()

    def merge(self, other: "Profile") -> "Profile":
        return Profile(self.counts + other.counts)

    def hottest_first(self, keys: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """keys ordered by count, hottest first. Ties go round-robin over layers
        (expert 0 of every layer, then expert 1, ...) so an unprofiled model spreads
        its cache evenly instead of filling the first layers."""
        return sorted(keys, key=lambda k: (-int(self.counts[k[0], k[1]]), k[1], k[0]))

    def skew(self) -> list[float]:
        """Per layer: share of routings that went to the top quarter of experts."""
        out = []
        for row in self.counts:
            total = row.sum()
            top = np.sort(row)[::-1][: max(1, len(row) // 4)].sum()
            out.append(float(top / total) if total else 0.0)
        return out


def dump_routing(out, layer: int, ids: list[list[int]], weights: list[list[float]], guesses: list | None) -> None:
    """One layer's routing, a JSON line a token (`generate --dump-routing`): its experts, their
    weights and, with look-ahead, what was predicted."""
    for t, (row_ids, row_w) in enumerate(zip(ids, weights)):
        row = {"layer": layer, "experts": row_ids, "weights": [round(w, 5) for w in row_w]}
        if guesses is not None:
            row["predicted"] = guesses[t]
        out.write(json.dumps(row) + "\n")


def no_profile_note(cached: int, total: int) -> str:
    """What serving without a profile costs, in the operator's words."""
    share = f"about {cached / total:.0%} of routings (a uniform guess)" if total else "a uniform guess's share"
    return (f"no expert profile: the cache starts in pack order and hits {share} until it adapts, instead of "
            "the hottest experts' much larger share; record one with `moefit profile PACK --prompts FILE` "
            "(a few hundred prompts like the ones it will serve)")

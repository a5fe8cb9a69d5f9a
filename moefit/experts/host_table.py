"""Where the host's kernels read each expert: per layer, a row of the native call's part
addresses for every expert (kernels.addresses: gate_up, its scales, down, its scales, and the
panels flag), filled as experts are first computed on the host and forgotten when they move.

The decode step's call reads the layer's row itself (kernels.step_post: the routing's ids index
it), so posting a token's experts costs the engine thread a check of k entries rather than the
grouping and a pointer list; calls over several tokens take the same addresses as a list
(`pointers`, moe_post). Where an expert's parts are is the runner's to say (`ExpertRunner._on_host`:
its slot of a host-memory card, the pack's map, or its int4 panels).
"""

from __future__ import annotations

from array import array

from moefit import kernels
from moefit.experts.cache import Key

WIDTH = len(kernels.PARTS) + 1                 # expert_ptrs: four part addresses and the panels flag


class HostTable:
    def __init__(self, runner, experts: int):
        self.runner, self.experts = runner, experts
        self.rows: dict[int, array] = {}     # layer -> [experts * WIDTH] int64; gate_up 0: not filled

    def forget(self, key: Key) -> None:
        """key's parts moved (placed in or evicted from a slot, rearranged into panels)."""
        row = self.rows.get(key[0])
        if row is not None:
            row[key[1] * WIDTH] = 0

    def current(self, layer: int) -> array:
        """The layer's row as it stands: the experts whose parts moved since forgotten, the rest
        where they were filled (a native call fills none: it reports an unfilled expert)."""
        for key in self.runner.panels.made_since():   # read from its rows until its panels were made
            self.forget(key)
        row = self.rows.get(layer)
        if row is None:
            row = self.rows[layer] = array("q", bytes(8 * WIDTH * self.experts))
        return row

    def row(self, layer: int, experts: list[int]) -> array:
        """The layer's row, with these experts' addresses where they are now."""
        row = self.current(layer)
        for e in experts:
            if row[e * WIDTH] == 0:
                parts, quant = self.runner._on_host(layer, e)
                row[e * WIDTH:(e + 1) * WIDTH] = array("q", kernels.addresses(parts, panels=quant == "int4p"))
        return row

    def pointers(self, layer: int, experts: list[int]) -> list[int]:
        """These experts' addresses, flat in their order (moe_post's pointer list)."""
        row = self.row(layer, experts)
        return [a for e in experts for a in row[e * WIDTH:(e + 1) * WIDTH]]

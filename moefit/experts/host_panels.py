"""int4 experts the host computes, kept in the order its kernel multiplies them.

The SIMD int4 bodies (AVX2, AVX-VNNI, AVX512-VNNI) multiply eight rows at a time from a panel (kernels/panels.h): the rows'
codes side by side, a lane a row. A matrix in the pack's row order is rearranged into panels on
every call: for a few tokens in registers, block by block, for more through a per-thread
buffer. Held in panel order it is read as it lies (Qwen3-30B-A3B's experts from memory, a layer
call of 8, 2 threads, bench/kernel.py --quants int4 int4p: on an AVX2 EPYC through the buffer
3.6 ms at one token, 1.15 held; on an AVX512 EPYC, transposed in registers, 1 token 0.84 against
0.81-0.90 held, 4 tokens 1.27-1.39 against 1.05-1.32, 16 tokens 4.8-5.1 against 4.5-4.6: since
the transpose in registers, holding them buys little at one token). So the first time the host computes an int4 expert, a copy in panel order is made
(kernels.rows_to_panels: the same bytes rearranged, the same tiles, so the same numbers bit for
bit) and read from then on, within a budget of host memory (--host-panels): auto = half the
memory available at start, at most the pack's int4 experts; off; or N MiB. Past the budget an
expert is read from the pack's map as before. Where the CPU's int4 body has no panels (portable
C) none are made.

The copies are host memory of their own, beside the pack's map (whose pages the kernel may then
drop from its cache): `report()` says how much (`expert_cache.host_panels` in /v1/status).
"""

from __future__ import annotations

from collections import deque

import torch

from moefit import kernels
from moefit.errors import UsageError

Key = tuple[int, int]
MATRICES = ("gate_up", "down")


def budget_bytes(setting: str, int4_bytes: int, available: int) -> int:
    """The budget of --host-panels: auto, off, or a number of MiB; 0 where the CPU's body reads rows."""
    if setting == "off" or not kernels.int4_panels():
        return 0
    if setting == "auto":
        return min(int4_bytes, available // 2)
    return int(setting) << 20


def check_setting(setting: str) -> None:
    if setting not in ("auto", "off") and not setting.isdigit():
        raise UsageError(f"--host-panels {setting}: auto, off or a number of MiB")


class HostPanels:
    """Panel-order copies of int4 experts, made on first use within `budget` bytes: on a worker
    (`maker`, the look-ahead's: experts/stager.py) where there is one, so that a host expert's
    first use does not wait for its copy (0.6 ms a Qwen3-30B-A3B expert on the H200's host,
    2.4 ms here) and reads the pack's rows once more instead (the same numbers, bit for bit);
    at once where there is none."""

    def __init__(self, budget: int = 0):
        self.budget = budget
        self.bytes = 0
        self.maker = None                      # call(job): runs job() on a worker
        self._held: dict[Key, dict[str, torch.Tensor]] = {}
        self._making: set[Key] = set()
        self._made = deque()                  # made on the worker since `made_since` last drained it

    def holds(self, key: Key) -> bool:
        return key in self._held

    def parts(self, key: Key, parts: dict[str, torch.Tensor], quant: str) -> dict[str, torch.Tensor] | None:
        """The expert's parts in panel order (quant "int4p"): made now (or on the worker) if it is
        int4 and fits the budget; None while it is not made (the caller reads `parts` as they are)."""
        held = self._held.get(key)
        if held is not None or quant != "int4" or not self.budget or key in self._making:
            return held
        need = sum(parts[m].nbytes + parts[m + ".scale"].nbytes for m in MATRICES)
        if self.bytes + need > self.budget:
            return None
        self.bytes += need
        if self.maker is None:
            return self._make(key, parts)
        self._making.add(key)
        self.maker(lambda: self._make(key, parts))
        return None

    def made_since(self) -> list[Key]:
        """The experts whose copies the worker finished since the last call (a caller that kept
        their rows' addresses takes the panels' now)."""
        out = []
        while self._made:
            out.append(self._made.popleft())
        return out

    def _make(self, key: Key, parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        held = dict(parts)
        for m in MATRICES:
            held[m], held[m + ".scale"] = kernels.rows_to_panels(parts[m], parts[m + ".scale"])
        self._held[key] = held                 # published whole, then announced
        self._making.discard(key)
        if self.maker is not None:
            self._made.append(key)
        return held

    def report(self) -> dict[str, int]:
        return {"experts": len(self._held), "making": len(self._making), "bytes": self.bytes, "budget": self.budget}

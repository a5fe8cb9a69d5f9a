"""A simulated card: how every memory behaviour is tested on a machine without a GPU.

    {"name": "RTX 4070 (simulated)", "total_mib": 12282,
     "processes": [{"pid": 2101, "name": "gnome-shell", "used_mib": 587}, ...],
     "unattributed_mib": 0, "allocator": "cuda"}

The file is re-read at every snapshot and every charge, so a test (or an operator) can
make the card dirty mid-run. What this process allocates on the card is charged here, by
the card's allocator model (memory/allocator.py: "cuda" charges the segments PyTorch's
caching allocator would reserve, "exact" the bytes asked; a card that does not say is
exact); an allocation past the card's free memory raises DeviceOutOfMemory, as CUDA would.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from moefit.errors import DeviceOutOfMemory, DeviceUnavailable
from moefit.memory.allocator import AllocatorModel
from moefit.memory.devices import MIB, DeviceSnapshot, ProcessUsage

THIS_PROCESS = "moefit (this process)"


class SimCard:
    def __init__(self, path: Path):
        self.path = Path(path)
        self._lock = threading.Lock()
        card = self._read()              # fail early on a missing or malformed card
        self.allocator = AllocatorModel(card.get("allocator", "exact"))

    @property
    def charged(self) -> int:
        """What this process holds on the card: the allocator's reserved bytes."""
        return self.allocator.reserved

    def _read(self) -> dict:
        try:
            card = json.loads(self.path.read_text())
            card["total_mib"] = float(card["total_mib"])
            if card.get("allocator", "exact") not in ("exact", "cuda"):
                raise ValueError(f"allocator must be exact or cuda, not {card['allocator']!r}")
            for p in card.setdefault("processes", []):
                p["used_mib"] = float(p["used_mib"])
            return card
        except FileNotFoundError:
            raise DeviceUnavailable(f"{self.path}: simulated card file not found") from None
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise DeviceUnavailable(f"{self.path}: not a valid simulated card ({type(e).__name__}: {e})") from None

    def snapshot(self) -> DeviceSnapshot:
        card = self._read()
        procs = [ProcessUsage(int(p["pid"]), str(p["name"]), int(p["used_mib"] * MIB)) for p in card["processes"]]
        if self.charged:
            procs.append(ProcessUsage(os.getpid(), THIS_PROCESS, self.charged))
        total = int(card["total_mib"] * MIB)
        unattributed = int(float(card.get("unattributed_mib", 0)) * MIB)
        free = max(0, total - sum(p.bytes for p in procs) - unattributed)
        return DeviceSnapshot(card.get("name", "simulated card"), total, free, tuple(procs),
                              card.get("uuid", f"sim:{self.path.name}"), "sim", unattributed)

    def charge(self, nbytes: int, what: str) -> int:
        """Allocate nbytes for `what`; returns the handle release() takes."""
        with self._lock:
            free, cost = self.snapshot().free_bytes, self.allocator.cost(nbytes)
            if cost > free:
                raise DeviceOutOfMemory(f"out of memory on {self.path.name}: {what} needs "
                                        f"{cost / MIB:.1f} MiB, {free / MIB:.1f} MiB free")
            return self.allocator.allocate(nbytes)

    def check_fits(self) -> None:
        """Raise DeviceOutOfMemory when the card holds more than it has: what a CUDA
        allocation mid-request would hit after another program took the memory."""
        card = self._read()
        used = sum(p["used_mib"] for p in card["processes"]) * MIB + self.charged
        used += float(card.get("unattributed_mib", 0)) * MIB
        if used > card["total_mib"] * MIB:
            raise DeviceOutOfMemory(f"out of memory on {self.path.name}: the card holds "
                                    f"{used / MIB:.1f} MiB of {card['total_mib']:.1f} MiB")

    def release(self, handle: int) -> None:
        """Free an allocation; under the cuda model its bytes stay reserved until empty_cache()."""
        with self._lock:
            self.allocator.free(handle)

    def empty_cache(self) -> int:
        with self._lock:
            return self.allocator.empty_cache()


def write_card(path: Path, name: str, total_mib: float, processes: list[tuple[int, str, float]],
               unattributed_mib: float = 0, allocator: str = "exact") -> None:
    """Write a card file atomically (tests and the demo use this)."""
    card = {"name": name, "total_mib": total_mib, "unattributed_mib": unattributed_mib, "allocator": allocator,
            "processes": [{"pid": pid, "name": n, "used_mib": mib} for pid, n, mib in processes]}
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(card, indent=1))
    os.replace(tmp, path)

"""The zero check: compare the card now with its saved clean baseline, name who holds
the difference, and wait for late-released memory. No torch.

    CLEAN        within tolerance of the baseline
    DIRTY        new or grown processes, or too much memory above the baseline
    NO BASELINE  none saved yet for this card (`moefit doctor --save-baseline`)
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from moefit.memory.devices import MIB, DeviceSnapshot
from moefit.memory.simcard import THIS_PROCESS

BASELINES = "baselines.json"


@dataclass(frozen=True)
class Tolerance:
    total_mib: float = 256        # used memory over the baseline, in all
    process_mib: float = 64       # a new process, or a process that grew


@dataclass(frozen=True)
class Culprit:
    pid: int
    name: str
    bytes_over: int
    why: str                      # "new" | "grew" | "previous moefit" | "no live process"


@dataclass
class ZeroCheck:
    verdict: str
    snapshot: DeviceSnapshot
    baseline: DeviceSnapshot | None
    over_bytes: int = 0
    culprits: list[Culprit] = field(default_factory=list)

    def headline(self) -> str:
        if self.verdict == "NO BASELINE":
            return ("NO BASELINE: no clean baseline saved for this card; on a clean card run "
                    "`moefit doctor --save-baseline`")
        if self.verdict == "CLEAN":
            return f"CLEAN: {'+' if self.over_bytes >= 0 else ''}{_mib(self.over_bytes)} against the baseline"
        names = ", ".join(f"{c.pid} {c.name} {_mib(c.bytes_over)} ({c.why})" for c in self.culprits)
        return f"DIRTY: {_mib(self.over_bytes)} above the baseline" + (f"; culprits: {names}" if names else "")

    def to_json(self) -> dict:
        return {"verdict": self.verdict, "over_bytes": self.over_bytes, "message": self.headline(),
                "baseline": self.baseline.to_json() if self.baseline else None,
                "culprits": [c.__dict__ for c in self.culprits]}


def _mib(n: int) -> str:
    return f"{n / MIB:.0f} MiB" if abs(n) >= 10 * MIB else f"{n / MIB:.2f} MiB"


def baseline_key(snap: DeviceSnapshot) -> str:
    return snap.uuid or snap.name


def load_baseline(state_dir: Path, snap: DeviceSnapshot) -> DeviceSnapshot | None:
    try:
        saved = json.loads((Path(state_dir) / BASELINES).read_text())
        return DeviceSnapshot.from_json(saved[baseline_key(snap)]["snapshot"])
    except (OSError, ValueError, KeyError):
        return None


def save_baseline(state_dir: Path, snap: DeviceSnapshot) -> Path:
    state_dir = Path(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    file = state_dir / BASELINES
    try:
        saved = json.loads(file.read_text())
    except (OSError, ValueError):
        saved = {}
    saved[baseline_key(snap)] = {"saved_at": time.time(), "snapshot": _without_self(snap).to_json()}
    tmp = file.with_name(file.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(saved, indent=1))
    os.replace(tmp, file)
    return file


def _without_self(snap: DeviceSnapshot) -> DeviceSnapshot:
    procs = tuple(p for p in snap.processes if p.pid != os.getpid() and p.name != THIS_PROCESS)
    own = sum(p.bytes for p in snap.processes) - sum(p.bytes for p in procs)
    return DeviceSnapshot(snap.name, snap.total_bytes, snap.free_bytes + own, procs, snap.uuid, snap.source,
                          snap.unattributed_bytes)


def check(snap: DeviceSnapshot, baseline: DeviceSnapshot | None, tol: Tolerance = Tolerance()) -> ZeroCheck:
    """Verdict of the card now against its baseline (this process's own memory excluded)."""
    snap = _without_self(snap)
    if baseline is None:
        return ZeroCheck("NO BASELINE", snap, None)
    over = snap.used_bytes - baseline.used_bytes
    culprits = _culprits(snap, baseline, tol)
    dirty = over > tol.total_mib * MIB or bool(culprits)
    return ZeroCheck("DIRTY" if dirty else "CLEAN", snap, baseline, over, culprits if dirty else [])


def _culprits(snap: DeviceSnapshot, baseline: DeviceSnapshot, tol: Tolerance) -> list[Culprit]:
    before: dict[str, int] = {}
    for p in baseline.processes:
        before[p.name] = before.get(p.name, 0) + p.bytes
    out = []
    for p in sorted(snap.processes, key=lambda p: -p.bytes):
        grew = p.bytes - before.pop(p.name, 0)
        if grew <= tol.process_mib * MIB:
            continue
        why = "previous moefit" if p.name.startswith("moefit") else ("new" if grew == p.bytes else "grew")
        out.append(Culprit(p.pid, p.name, grew, why))
    late = snap.unattributed_bytes - baseline.unattributed_bytes
    if late > tol.process_mib * MIB:
        out.append(Culprit(0, "(held by no live process: released late by the driver)", late, "no live process"))
    return out


@dataclass
class Settled:
    stable: bool
    waited_s: float
    first: DeviceSnapshot
    last: DeviceSnapshot

    def describe(self) -> str:
        delta = (self.last.free_bytes - self.first.free_bytes) / MIB
        state = "stable" if self.stable else "still changing"
        return f"free memory {state} after {self.waited_s:.1f} s ({delta:+.0f} MiB free while waiting)"


def wait_release(read, timeout_s: float, interval_s: float = 1.0, band_mib: int = 64) -> Settled:
    """Read the card until free memory is stable: three reads in a row within band_mib."""
    t0 = time.monotonic()
    first = last = read()
    window = [first.free_bytes]
    while True:
        if len(window) >= 3 and max(window[-3:]) - min(window[-3:]) <= band_mib * MIB:
            return Settled(True, time.monotonic() - t0, first, last)
        if time.monotonic() - t0 >= timeout_s:
            return Settled(False, time.monotonic() - t0, first, last)
        time.sleep(interval_s)
        last = read()
        window.append(last.free_bytes)

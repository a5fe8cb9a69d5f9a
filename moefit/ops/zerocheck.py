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
                    "`moefit doctor --save-baseline`" + self.leftover_note())
        if self.verdict == "CLEAN":
            return f"CLEAN: {'+' if self.over_bytes >= 0 else ''}{_mib(self.over_bytes)} against the baseline"
        names = ", ".join(f"{c.pid} {c.name} {_mib(c.bytes_over)} ({c.why})" for c in self.culprits)
        return f"DIRTY: {_mib(self.over_bytes)} above the baseline" + (f"; culprits: {names}" if names else "")

    def leftover_note(self) -> str:
        olds = [c for c in self.culprits if c.why == "previous moefit"]
        if not olds:
            return ""
        names = ", ".join(f"pid {c.pid} {c.name} {_mib(c.bytes_over)}" for c in olds)
        return f"; another moefit holds the card ({names}): likely a leftover instance, stop it first"

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
        leftovers = [Culprit(p.pid, p.name, p.bytes, "previous moefit") for p in snap.processes if is_moefit(p, snap)]
        return ZeroCheck("NO BASELINE", snap, None, culprits=leftovers)
    over = snap.used_bytes - baseline.used_bytes
    culprits = _culprits(snap, baseline, tol)
    dirty = over > tol.total_mib * MIB or bool(culprits)
    return ZeroCheck("DIRTY" if dirty else "CLEAN", snap, baseline, over, culprits if dirty else [])


def _culprits(snap: DeviceSnapshot, baseline: DeviceSnapshot, tol: Tolerance) -> list[Culprit]:
    before = matched_baseline(snap.processes, baseline.processes)
    out = []
    for p in sorted(snap.processes, key=lambda p: -p.bytes):
        grew = p.bytes - (before[p.pid] or 0)
        if grew <= tol.process_mib * MIB:
            continue
        why = "previous moefit" if is_moefit(p, snap) else ("new" if before[p.pid] is None else "grew")
        out.append(Culprit(p.pid, p.name, grew, why))
    late = snap.unattributed_bytes - baseline.unattributed_bytes
    if late > tol.process_mib * MIB:
        out.append(Culprit(0, "(held by no live process: released late by the driver)", late, "no live process"))
    return out


def matched_baseline(now, then) -> dict[int, int | None]:
    """pid now -> its bytes in the baseline: the same pid and name, else an unmatched baseline
    process of the same name (largest with largest), else None (new). Two processes of one
    name are two rows, each with its own baseline."""
    left = list(then)
    out: dict[int, int | None] = {}
    for p in now:
        same = next((b for b in left if b.pid == p.pid and b.name == p.name), None)
        if same is not None:
            out[p.pid] = same.bytes
            left.remove(same)
    for p in sorted(now, key=lambda p: -p.bytes):
        if p.pid in out:
            continue
        same = next((b for b in sorted(left, key=lambda b: -b.bytes) if b.name == p.name), None)
        out[p.pid] = None if same is None else same.bytes
        if same is not None:
            left.remove(same)
    return out


def is_moefit(p, snap: DeviceSnapshot) -> bool:
    """Another moefit: by name, or (real cards, where NVML names the interpreter) by command line."""
    if p.name.startswith("moefit") or "moefit" in p.name.split("/")[-1]:
        return True
    if snap.source != "nvml":
        return False
    import psutil
    try:
        return any("moefit" in part for part in psutil.Process(p.pid).cmdline()[:3])
    except psutil.Error:
        return False


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

"""Run named checks in a child process, so that one that hangs, or one that breaks the CUDA
context (an illegal address poisons every later call in that process), costs only itself.

    results = run_isolated(child_argv, ["greedy", "cache", ...], limit_s={"decode": 300}, budget_s=420)

The child (`child_argv(names, journal)`) runs the names in order and appends to the journal,
one JSON line each: {"start": name} before a check, {"partial": {...}} as a long one goes, and
{"name": name, "result": {...}} after it. The parent watches the journal: a check over its limit, or over what is left of the
budget, is killed with its child; a child that dies mid-check leaves that check failed with
its exit code. Either way a fresh child takes the remaining names. Checks the budget does
not reach are recorded as skipped. `on_result(name, result)` sees each one as it lands.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

DEFAULT_LIMIT_S = 120


def run_isolated(child_argv, names: list[str], limit_s: dict[str, float], budget_s: float,
                 on_result=lambda name, result: None) -> dict[str, dict]:
    deadline, results = time.time() + budget_s, {}
    todo = list(names)
    while todo and time.time() < deadline:
        journal = Path(tempfile.mkstemp(suffix=".jsonl")[1])
        child = subprocess.Popen(child_argv(todo, journal), start_new_session=True)
        landed = 0
        for name, result in _watch(child, journal, limit_s, deadline):
            results[name], landed = result, landed + 1
            todo.remove(name)
            on_result(name, result)
        journal.unlink(missing_ok=True)
        if not landed:                              # it could not even start a check: no retry
            for name in todo:
                results[name] = {"ok": False, "error": f"the checks' process exited ({child.returncode}) first"}
                on_result(name, results[name])
            return results
    for name in todo:
        results[name] = {"ok": None, "skipped": f"the {budget_s:.0f} s budget was spent"}
        on_result(name, results[name])
    return results


def _watch(child: subprocess.Popen, journal: Path, limit_s: dict, deadline: float):
    """Yield (name, result) as the child finishes checks; a killed or dead child's current
    check is yielded failed, and the watch ends with the child."""
    seen, current, started, partial = 0, None, 0.0, None
    while True:
        alive = child.poll() is None                # read after: what a dying child wrote is seen
        for line in journal.read_text().split("\n")[:-1][seen:]:     # whole lines only
            seen += 1
            entry = json.loads(line)
            if "start" in entry:
                current, started, partial = entry["start"], time.time(), None
            elif "partial" in entry:
                partial = entry["partial"]
            else:
                current = None
                yield entry["name"], entry["result"]
        if not alive:
            if current is not None:
                yield current, {"ok": False, "error": f"the check's process died (exit code {child.returncode})",
                                "seconds": round(time.time() - started, 1), "partial": partial}
            return
        if current is not None:
            ran = time.time() - started
            if ran > limit_s.get(current, DEFAULT_LIMIT_S) or time.time() > deadline:
                _kill(child)
                yield current, {"ok": False, "error": f"stopped after {ran:.0f} s: over its limit or the budget",
                                "seconds": round(ran, 1), "partial": partial}
                return
        time.sleep(0.2)


def _kill(child: subprocess.Popen) -> None:
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    child.wait()


class Journal:
    """The child's side: one JSON line per event, flushed at once."""

    def __init__(self, path: str):
        self.path = path

    def start(self, name: str) -> None:
        self._write({"start": name})

    def partial(self, result: dict) -> None:
        """What the running check has so far: kept if it is stopped before it finishes."""
        self._write({"partial": result})

    def done(self, name: str, result: dict) -> None:
        self._write({"name": name, "result": result})

    def _write(self, entry: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(entry, default=str) + "\n")

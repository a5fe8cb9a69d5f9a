"""What this machine's host measured, kept across starts: each prompt product's fastest way
(kernels/gemm.py) and each expert quant's GEMM crossover (experts/host_rates.py, `auto`), in
<state dir>/measured.json under a key for the host (CPU model, the pool's threads, torch, the
kernels' instruction set and revision). A start on the same host takes them as they were: its prompts run the
ways the last start's did from the first request on, without timing them again (a fresh process
paid 1-2 s on its first prompt of each size for that), and two starts of one configuration do
not differ by a noisy timing. Another host, or the file removed, measures afresh.

    restore(state_dir, rates)   before the first request; returns how many choices it took
    keep(state_dir, rates)      whenever the start's record is written (Start.finish)
"""

from __future__ import annotations

import json
from pathlib import Path
import platform

import torch

from moefit import kernels
from moefit.kernels import gemm
from moefit.pack.format import write_json_atomic

FILE = "measured.json"


def host_key() -> str:
    lib = kernels.library()
    threads = lib.moe_threads() if lib is not None and hasattr(lib, "moe_threads") else 1
    return f"{cpu_model()} | {threads} threads | torch {torch.__version__} | {kernels.isa()} r{kernels.REVISION}"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def restore(state_dir: Path, rates) -> int:
    """This host's kept choices into gemm's and rates' tables (a crossover only where --expert-gemm-rows
    is auto, the one setting that measures)."""
    kept = _read(Path(state_dir)).get(host_key())
    try:
        ways = {tuple(key): str(way) for key, way in kept["ways"]}
        crossovers = {str(q): int(rows) for q, rows in kept["crossovers"].items()} if rates.setting == "auto" else {}
    except (TypeError, ValueError, KeyError, AttributeError):          # none kept, or not a file of ours
        return 0
    gemm._way_for.update(ways)
    rates.crossovers.update(crossovers)
    return len(ways) + len(crossovers)


def keep(state_dir: Path, rates) -> None:
    """This host's choices so far into the file (other hosts' entries kept); a state directory that
    cannot be written is skipped: the next start measures again."""
    path = Path(state_dir) / FILE
    data = _read(Path(state_dir))
    entry = {"ways": [[list(key), way] for key, way in gemm._way_for.items()],
             "crossovers": dict(rates.crossovers) if rates.setting == "auto" else {}}
    if data.get(host_key()) == entry:
        return
    data[host_key()] = entry
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, data)
    except OSError:
        pass


def _read(state_dir: Path) -> dict:
    try:
        data = json.loads((state_dir / FILE).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}

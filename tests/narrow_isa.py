"""Run a test module's check under a narrower instruction set: MOEFIT_ISA caps what the native
kernel picks (portable, avx2, avx-vnni), so every body runs on this machine in a subprocess.
AVX-VNNI's bodies (desktop parts since Alder Lake and Zen 5) need a CPU that has it: on one
without it (AMD's Zen 4, older Intel) those checks are skipped, not run on AVX2's bodies."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

NARROWER = ("portable", "avx2", "avx-vnni")
CPU_FLAG = {"avx-vnni": "avx_vnni"}           # an instruction set this project's machines may lack: its cpuinfo flag


def cpu_has(isa: str) -> bool:
    """Whether this CPU runs isa's bodies (from /proc/cpuinfo's flags; portable and AVX2 always)."""
    flag = CPU_FLAG.get(isa)
    if flag is None:
        return True
    try:
        return any(flag in line.split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("flags"))
    except OSError:
        return False


def skip_unless_cpu_has(isa: str) -> None:
    if not cpu_has(isa):
        pytest.skip(f"this CPU has no {isa}: its bodies need one that does")


def run_under(isa: str, code: str) -> str:
    """Python code in a subprocess (in tests/) with the kernel capped at isa; its stdout (skipped
    where this CPU lacks isa)."""
    skip_unless_cpu_has(isa)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).parent, env={**os.environ, "MOEFIT_ISA": isa})
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout


def check_under(isa: str, module: str, check: str) -> None:
    """module.check() in a subprocess with the kernel capped at isa; it returns kernels.isa()."""
    assert run_under(isa, f"from {module} import {check}; print({check}())").strip().splitlines()[-1] == isa


def computed_under(isa: str, module: str, make: str, tmp_path: Path):
    """The tensor module.make() returns, computed in a subprocess with the kernel capped at isa."""
    import torch
    out = tmp_path / f"{make}-{isa}.pt"
    run_under(isa, f"import torch, {module} as m; torch.save(m.{make}(), {str(out)!r})")
    return torch.load(out)

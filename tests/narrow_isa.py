"""Run a test module's check under a narrower instruction set: MOEFIT_ISA caps what the native
kernel picks (portable, avx2, avx-vnni), so every body runs on this machine in a subprocess."""

import os
import subprocess
import sys
from pathlib import Path


def run_under(isa: str, code: str) -> str:
    """Python code in a subprocess (in tests/) with the kernel capped at isa; its stdout."""
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

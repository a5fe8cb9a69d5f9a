"""Run a test module's check under a narrower instruction set: MOEFIT_ISA caps what the native
kernel picks (portable, avx2, avx-vnni), so every body runs on this machine in a subprocess."""

import os
import subprocess
import sys
from pathlib import Path


def check_under(isa: str, module: str, check: str) -> None:
    """module.check() in a subprocess with the kernel capped at isa; it returns kernels.isa()."""
    run = subprocess.run([sys.executable, "-c", f"from {module} import {check}; print({check}())"],
                         capture_output=True, text=True, timeout=300, cwd=Path(__file__).parent,
                         env={**os.environ, "MOEFIT_ISA": isa})
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == isa

"""Host kernels for quantised experts, compiled on first use with the system C compiler
and loaded with ctypes. Without a compiler moefit falls back to torch (dequantise, then
matmul): correct, slower. MOEFIT_NO_KERNELS=1 forces the fallback (the only environment
variable moefit reads, for benchmarks that compare the two paths)."""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import sysconfig
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("qgemv.c")
MAX_ROWS_T = 16                     # above this many tokens a dequantise + GEMM wins
_lib: ctypes.CDLL | None | bool = None


def _build_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "moefit" / "kernels"


def _compile() -> ctypes.CDLL | None:
    if os.environ.get("MOEFIT_NO_KERNELS"):
        return None
    src = SOURCE.read_bytes()
    tag = hashlib.sha256(src + sysconfig.get_platform().encode()).hexdigest()[:12]
    lib = _build_dir() / f"qgemv-{tag}.so"
    if not lib.exists():
        lib.parent.mkdir(parents=True, exist_ok=True)
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        cmd = [os.environ.get("CC", "cc"), "-O3", "-march=native", "-fopenmp-simd", "-shared", "-fPIC",
               str(SOURCE), "-o", str(tmp)]
        try:
            subprocess.run(cmd, check=True, capture_output=True, timeout=120)
        except (OSError, subprocess.SubprocessError):
            return None
        os.replace(tmp, lib)
    try:
        return ctypes.CDLL(str(lib))
    except OSError:
        return None


def library() -> ctypes.CDLL | None:
    global _lib
    if _lib is None:
        _lib = _compile() or False
    return _lib or None


def usable(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.float32 and x.shape[0] <= MAX_ROWS_T and library() is not None


def _p(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def qgemv(x: torch.Tensor, parts: dict, name: str, quant: str) -> torch.Tensor:
    """x [T, C] fp32 times the quantised W [R, C]^T -> [T, R] fp32."""
    x = x.contiguous()
    w = parts[name]
    scale = parts[name + ".scale"]
    t, c, r = x.shape[0], x.shape[1], w.shape[0]
    y = torch.empty(t, r, dtype=torch.float32)
    lib = library()
    if quant == "int8":
        lib.qgemv_int8(_p(x), _p(w), _p(scale), _p(y), ctypes.c_int64(t), ctypes.c_int64(r), ctypes.c_int64(c))
    else:
        scale32 = parts.get(name + ".scale_f32")
        if scale32 is None:                    # fp16 scales widened once per expert, kept with its parts
            scale32 = parts[name + ".scale_f32"] = scale.float().contiguous()
        group = c // scale.shape[1]
        lib.qgemv_int4(_p(x), _p(w), _p(scale32), _p(y), ctypes.c_int64(t), ctypes.c_int64(r), ctypes.c_int64(c),
                       ctypes.c_int64(group))
    return y

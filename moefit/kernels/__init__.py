"""The native host kernels (moe.c), built at install time (setup.py) and loaded with ctypes.

- moe_layer: one call per MoE layer for the routed experts computed on the host, posted to the
  pool while the caller goes on (layer_call.py);
- qlinear: one quantised matrix (the dense path with --dense-quant); dequantize: one as fp32
  rows (for a prompt's product where torch's fp32 GEMM runs its shape faster here: gemm.py);
- the float operations between them (RMSNorm, QK-norm + RoPE, one position's attention):
  rows.h, called from rows.py.

Both quantise activations per block of 32 to int8 and use integer dot products chosen at run
time (AVX2, AVX-VNNI, AVX512-VNNI, portable C). Without the built library (no compiler at
install time) moefit says so once and uses torch (dequantise, then matmul).

Threads: a pthread pool of `set_threads(n)` (default: the physical cores). Its workers spin
~1 ms after a phase (pool.h), then sleep. How it shares the cores with torch's own threads is decided,
and measured, in runtime/loader.py (set_threads).
"""

from __future__ import annotations

from contextlib import contextmanager
import ctypes
import importlib.machinery
import logging
import os
from pathlib import Path
import threading

import torch

from moefit.pack.layout import GGUF_BLOCKS, matrix_quants

log = logging.getLogger("moefit.kernels")
HERE = Path(__file__).parent
_lib: ctypes.CDLL | None | bool = None
# the C side's quant codes; the GGUF super-block types carry their scales inside (kquants.h)
Q = {"int8": 8, "int4": 4, "int4p": 5, "q8_0": 9, "q4_k": 10, "q5_k": 11, "q6_k": 12, "iq4_xs": 13, "mxfp4": 14}
GROUPED = ("int4", "int4p", "q8_0")             # a scale per (row, group of inputs)
# Raised when a body's speed changes (2: int4 in panels of eight rows on AVX2, panels.h; 3: on
# AVX-VNNI and AVX512-VNNI too; 4: the GGUF block types four tokens a row, ktiles.h, and Q4_K in
# panels, kpanels.h; 5: IQ4_XS and MXFP4 in panels; 6: a prompt's Q6_K in decoded panels,
# kdecoded.h; 7: a decode step's Q6_K rows read ahead and without the sign trick, ktiles.h; 8: a
# prompt's layer call on kept scratch, scratch.h; 9: Q4_K's and Q5_K's sums of several tokens in
# registers, kpanels.h; 10: IQ4_XS's and MXFP4's sums in two chains on VNNI): the choices a host
# measured and kept (ops/measured.py) are then measured again.
REVISION = 10
ABI = 9                                         # moe.c's moe_abi(): the exported functions' arguments
c_i64, c_ptr = ctypes.c_int64, ctypes.c_void_p


def _find() -> Path | None:
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        if (HERE / f"_moe{suffix}").exists():
            return HERE / f"_moe{suffix}"
    return None


def _load() -> ctypes.CDLL | None:
    if os.environ.get("MOEFIT_NO_KERNELS"):
        return None
    path = _find()
    if path is None:
        log.warning("the native host kernel is not built (no C compiler when moefit was installed?): "
                    "experts run through torch, several times slower; reinstall with a compiler to build it")
        return None
    lib = ctypes.CDLL(str(path))
    abi = lib.moe_abi() if hasattr(lib, "moe_abi") else 1
    if abi != ABI:
        log.warning(f"the native host kernel at {path} was built from other sources (ABI {abi}, this moefit "
                    f"calls {ABI}): rebuild it (pip install -e . or python setup.py build_ext --inplace); "
                    "until then experts run through torch, several times slower")
        return None
    lib.moe_layer.restype = lib.moe_linear.restype = lib.moe_set_threads.restype = ctypes.c_int
    lib.moe_layer.argtypes = [c_ptr, c_i64, c_i64, c_i64, ctypes.c_int, c_i64, c_i64, c_ptr, c_ptr, c_ptr, c_ptr,
                              c_ptr]
    lib.moe_linear.argtypes = [c_ptr, c_i64, c_i64, c_i64, ctypes.c_int, c_i64, c_ptr, c_ptr, c_ptr]
    lib.moe_layer_act.restype = lib.moe_layer_wait.restype = ctypes.c_int
    lib.moe_layer_act.argtypes = lib.moe_layer.argtypes + [ctypes.c_float, ctypes.c_float, c_ptr, c_ptr]
    lib.moe_layer_post.restype, lib.moe_layer_post.argtypes = c_i64, lib.moe_layer_act.argtypes
    lib.moe_layer_wait.argtypes = [c_i64]
    lib.moe_step_post.restype = lib.moe_swiglu_post.restype = c_i64
    lib.moe_swiglu_post.argtypes = [c_ptr, c_i64, c_i64, c_i64, ctypes.c_int, c_i64, c_ptr, c_ptr, ctypes.c_int, c_i64,
                                    c_ptr, c_ptr, c_ptr]
    lib.moe_step_post.argtypes = [c_ptr, c_i64, c_i64, ctypes.c_int, c_i64, c_i64, c_ptr, c_ptr, c_ptr, c_ptr, c_ptr]
    lib.moe_route_step_post.restype = c_i64
    lib.moe_route_step_post.argtypes = [c_ptr, c_i64, c_ptr, c_i64, ctypes.c_int, c_i64, c_ptr, c_ptr, c_ptr, c_ptr,
                                        c_ptr]
    lib.moe_isa.restype = ctypes.c_char_p
    lib.moe_set_threads(default_threads())
    return lib


_this_thread = threading.local()


def library() -> ctypes.CDLL | None:
    global _lib
    if _lib is None:
        _lib = _load() or False
    return None if host_calls_are_off() else _lib or None


def host_calls_are_off() -> bool:
    return getattr(_this_thread, "off", False)


@contextmanager
def host_calls_off():
    """No native call on this thread for a while (the callers take torch's path): a recorded
    piece of a forward replays aten operations only (runtime/recorders.py)."""
    before = getattr(_this_thread, "off", False)
    _this_thread.off = True
    try:
        yield
    finally:
        _this_thread.off = before


def default_threads() -> int:
    import psutil
    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


def set_threads(n: int) -> int:
    """Threads of the kernel pool (the calling thread counts as one); returns what it got."""
    lib = library()
    return lib.moe_set_threads(max(1, n)) if lib else 1


@contextmanager
def torch_threads(when: bool = True):
    """torch's intra-op threads raised to the pool's for large operations (a prompt's GEMM, or a
    whole prompt chunk's forward), then back: with the dense matrices in the pool torch otherwise
    keeps one (runtime/loader.py). when=False: unchanged."""
    before = torch.get_num_threads()
    lib = library()
    want = lib.moe_threads() if when and lib and hasattr(lib, "moe_threads") else before
    if want > before:
        torch.set_num_threads(want)
    try:
        yield
    finally:
        if want > before:
            torch.set_num_threads(before)


def isa() -> str:
    lib = library()
    return lib.moe_isa().decode() if lib else "torch"


def usable(x: torch.Tensor, quant: str) -> bool:
    return (all(q in Q for q in matrix_quants(quant)) and x.device.type == "cpu" and x.dtype == torch.float32
            and library() is not None)


def code(quant: str) -> int:
    """A blob's quant for the C side: gate_up's code, and down's in bits 8-15 when it differs."""
    gate_up, down = matrix_quants(quant)
    return Q[gate_up] | (Q[down] << 8 if down != gate_up else 0)


def group_of(quant: str, cols: int, scale: torch.Tensor | None) -> int:
    """The group size the C side takes for a matrix of `cols` inputs: a scale per (row, group) for
    the grouped quants, 0 for the others (a scale per row, or inside the blocks)."""
    return cols // scale.shape[1] if quant in GROUPED else 0


def matrix_shape(codes: torch.Tensor, quant: str) -> tuple[int, int]:
    """(rows, columns) of a quantised matrix from its codes (int4: two codes a byte; the GGUF
    block types: bytes of blocks)."""
    if quant in GGUF_BLOCKS:
        weights, nbytes = GGUF_BLOCKS[quant]
        return codes.shape[0], codes.shape[1] // nbytes * weights
    return codes.shape[0], codes.shape[1] * (2 if quant in ("int4", "int4p") else 1)


def _p(t: torch.Tensor) -> int:
    """t's address, for an argument declared c_void_p (every function here declares its argtypes):
    ctypes converts the int itself, without a c_void_p object per argument."""
    return t.data_ptr()


def qlinear(x: torch.Tensor, parts: dict, name: str, quant: str) -> torch.Tensor | None:
    """x [T, C] fp32 times the quantised W [R, C]^T -> [T, R] fp32, or None for shapes the
    kernel does not take (C not a multiple of 32): BoundMatrix's call, bound for this one."""
    return BoundMatrix(parts, name, quant)(x.contiguous())


class BoundMatrix:
    """One quantised host matrix's call (moe_linear) with its arguments bound once: a dense
    matrix's decode-step product (layers.QWeight) then skips the lookups and checks that on a
    slow host cost more than a small matrix's product (a decode layer makes four to six)."""

    def __init__(self, parts: dict, name: str, quant: str):
        w, scale = parts[name], parts[name + ".scale"]
        self.rows, self.cols = matrix_shape(w, quant)
        lib = library()
        self.fn = lib.moe_linear if lib is not None and w.is_cpu and quant in Q else None   # it refuses what it lacks
        self.args = (self.cols, self.rows, Q.get(quant, 0), group_of(quant, self.cols, scale), w.data_ptr(),
                     scale.data_ptr())
        self.keep = (w, scale)                                   # the addresses above stay theirs

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        """x [T, C] fp32 host rows -> [T, R] fp32, or None where it does not apply."""
        if self.fn is None or x.dtype is not torch.float32 or not x.is_cpu or not x.is_contiguous() \
                or x.shape[-1] != self.cols:
            return None
        y = torch.empty(x.shape[0], self.rows, dtype=torch.float32)
        return y if self.fn(x.data_ptr(), x.shape[0], *self.args, y.data_ptr()) == 0 else None


def linear_heads(x: torch.Tensor, w: BoundMatrix, heads: int) -> torch.Tensor | None:
    """Each head through its own matrix (moe_linear_heads): x [H, T, C] fp32 and the H matrices
    [R, C] stacked [H R, C] -> [H, T, R], or None where it does not apply."""
    lib = library()
    if w.fn is None or not hasattr(lib, "moe_linear_heads") or x.dtype is not torch.float32 or not x.is_cpu \
            or not x.is_contiguous() or x.dim() != 3 or x.shape[0] != heads or x.shape[2] != w.cols \
            or w.rows % heads:
        return None
    if lib.moe_linear_heads.argtypes is None:
        lib.moe_linear_heads.argtypes = [c_ptr, c_i64, c_i64, c_i64, c_i64, ctypes.c_int, c_i64, c_ptr, c_ptr, c_ptr]
        lib.moe_linear_heads.restype = ctypes.c_int
    y = torch.empty(heads, x.shape[1], w.rows // heads, dtype=torch.float32)
    ok = lib.moe_linear_heads(x.data_ptr(), heads, x.shape[1], w.cols, w.rows // heads, *w.args[2:], y.data_ptr())
    return y if ok == 0 else None


def swiglu_takes(x: torch.Tensor, gate_up: BoundMatrix, down: BoundMatrix) -> bool:
    """Whether moe_swiglu (or its posted form, layer_call.swiglu_post) takes x with these matrices."""
    return not (gate_up.fn is None or down.fn is None or library() is None or x.dtype is not torch.float32
                or not x.is_cpu or not x.is_contiguous() or x.shape[-1] != gate_up.cols or down.cols * 2 != gate_up.rows)


def swiglu(x: torch.Tensor, gate_up: BoundMatrix, down: BoundMatrix) -> torch.Tensor | None:
    """A SwiGLU MLP of two bound host matrices in one call (moe_swiglu): x [T, E] fp32 -> [T, E],
    or None where it does not apply (then the caller runs it op by op)."""
    if not swiglu_takes(x, gate_up, down):
        return None
    lib = library()
    if lib.moe_swiglu.argtypes is None:
        lib.moe_swiglu.argtypes = [c_ptr, c_i64, c_i64, c_i64, ctypes.c_int, c_i64, c_ptr, c_ptr, ctypes.c_int, c_i64,
                                   c_ptr, c_ptr, c_ptr]
        lib.moe_swiglu.restype = ctypes.c_int
    y = torch.empty(x.shape[0], down.rows, dtype=torch.float32)
    ok = lib.moe_swiglu(x.data_ptr(), x.shape[0], gate_up.cols, down.cols, *gate_up.args[2:], *down.args[2:],
                        y.data_ptr())
    return y if ok == 0 else None


def dequantize(parts: dict, name: str, quant: str, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """The quantised matrix `name` (any of Q's quants) as fp32 [R, C] (into out, contiguous, when
    given), each weight as pack/quant.py's dequantize computes it, over the pool; None where the
    library lacks it or the shape is not its."""
    lib = library()
    if lib is None or not hasattr(lib, "moe_dequant") or quant not in Q:
        return None
    if lib.moe_dequant.argtypes is None:
        lib.moe_dequant.argtypes = [c_ptr, c_ptr, ctypes.c_int, c_i64, c_i64, c_i64, c_ptr]
        lib.moe_dequant.restype = ctypes.c_int
    w, scale = parts[name], parts.get(name + ".scale")
    r, c = matrix_shape(w, quant)
    out = torch.empty(r, c, dtype=torch.float32) if out is None else out
    ok = lib.moe_dequant(_p(w), _p(scale) if scale is not None else None, Q[quant], r, c,
                         group_of(quant, c, scale), _p(out))
    return out if ok == 0 else None


WEIGHT_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def quantize(w: torch.Tensor, quant: str, group: int) -> list[torch.Tensor] | None:
    """A weight matrix w [R, C] (fp32, fp16 or bf16, on the host) as int8, int4 or q8_0 parts, bit
    for bit pack/quant.py's quantize_in_torch, over the pool (weights.h); None where the library
    lacks it or the matrix is not one it takes."""
    lib = library()
    if (lib is None or not hasattr(lib, "moe_quantize") or quant not in ("int8", "int4", "q8_0") or w.dim() != 2
            or w.dtype not in WEIGHT_DTYPES or w.device.type != "cpu"):
        return None
    if lib.moe_quantize.argtypes is None:
        lib.moe_quantize.argtypes = [c_ptr, ctypes.c_int, c_i64, c_i64, ctypes.c_int, c_i64, c_ptr, c_ptr]
        lib.moe_quantize.restype = ctypes.c_int
    w = w.contiguous()
    rows, cols = w.shape
    if quant == "int8":
        codes, scale = torch.empty(rows, cols, dtype=torch.int8), torch.empty(rows, dtype=torch.float32)
    elif quant == "int4":
        if group <= 0 or cols % group or group % 2:
            return None
        codes, scale = torch.empty(rows, cols // 2, dtype=torch.uint8), torch.empty(rows, cols // group, dtype=torch.float16)
    else:
        codes, scale = torch.empty(rows, cols, dtype=torch.int8), torch.empty(rows, cols // 32, dtype=torch.float16)
    ok = lib.moe_quantize(_p(w), WEIGHT_DTYPES[w.dtype], rows, cols, Q[quant], group, _p(codes), _p(scale))
    return [codes, scale] if ok == 0 else None


def q8_round(x: torch.Tensor) -> torch.Tensor | None:
    """x [T, C] fp32 with each block of 32 as the integer dots see it (int8 codes times their scale,
    moe.c's quantize_row), over the pool; None where the library lacks it or C is not whole blocks."""
    lib = library()
    if lib is None or not hasattr(lib, "moe_q8_round"):
        return None
    if lib.moe_q8_round.argtypes is None:
        lib.moe_q8_round.argtypes = [c_ptr, c_i64, c_i64, c_ptr]
        lib.moe_q8_round.restype = ctypes.c_int
    x = x.contiguous()
    out = torch.empty_like(x)
    return out if lib.moe_q8_round(_p(x), x.shape[0], x.shape[1], _p(out)) == 0 else None


# ---- int4 stored in panels of 8 rows (panels.h): a dense matrix quantised at load, on CPUs whose
# kernel multiplies int4 in panels, is kept that way ("int4p"), so that a decode step's product
# does not rearrange it every call. The first rows - rows % 8 rows become panels in place (codes
# [nb][4 quads][8 rows][4 bytes], scales [groups][8 rows]); the rest stay rows. Same bytes.
PANEL = 8


def int4_panels() -> bool:
    """Whether this CPU's kernel multiplies int4 in panels (every SIMD body), so takes "int4p"."""
    lib = library()
    return bool(lib is not None and hasattr(lib, "moe_int4_panels") and lib.moe_int4_panels())


def rows_to_panels(codes: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int4 parts (codes [R, C/2] uint8, scale [R, G] fp16) -> the same in panel order: natively
    (moe_to_panels, at the speed of a copy), else in torch (~10x slower)."""
    lib = library()
    if lib is not None and hasattr(lib, "moe_to_panels") and codes.is_contiguous() and scale.is_contiguous():
        if lib.moe_to_panels.argtypes is None:
            lib.moe_to_panels.argtypes = [c_ptr, c_ptr, c_i64, c_i64, c_i64, c_ptr, c_ptr]
            lib.moe_to_panels.restype = ctypes.c_int
        out_c, out_s = torch.empty_like(codes), torch.empty_like(scale)
        rows, cols = codes.shape[0], codes.shape[1] * 2
        group = cols // scale.shape[1] if scale.shape[1] else 0
        if group and lib.moe_to_panels(_p(codes), _p(scale), rows, cols, group, _p(out_c), _p(out_s)) == 0:
            return out_c, out_s
    return _reorder(codes, scale, to_panels=True)


def panels_to_rows(parts: dict, name: str) -> dict:
    """{name, name.scale} of an "int4p" matrix back in row order."""
    codes, scale = _reorder(parts[name], parts[name + ".scale"], to_panels=False)
    return {name: codes, name + ".scale": scale}


def _reorder(codes: torch.Tensor, scale: torch.Tensor, to_panels: bool) -> tuple[torch.Tensor, torch.Tensor]:
    rows, half = codes.shape
    groups, head = scale.shape[1], rows - rows % PANEL
    as_rows = (head // PANEL, PANEL, half // 16, 4, 4)                  # panel, row, block, quad, byte
    as_panels = (head // PANEL, half // 16, 4, PANEL, 4)
    order = (0, 2, 3, 1, 4) if to_panels else (0, 3, 1, 2, 4)
    c = codes[:head].reshape(as_rows if to_panels else as_panels).permute(order).reshape(head, half)
    s = scale[:head].reshape((head // PANEL, PANEL, groups) if to_panels else (head // PANEL, groups, PANEL))
    s = s.transpose(1, 2).reshape(head, groups)
    return torch.cat([c, codes[head:]]), torch.cat([s, scale[head:]])


# the MoE layer's call (kernels/layer_call.py), here with the rest of the native interface
from moefit.kernels.layer_call import (PARTS, STEP_MOST, GptOssAct, NativeCall, Router, StepAct, addresses,  # noqa: E402,F401
                                      moe_layer, moe_post, route_post, step_post, swiglu_post)

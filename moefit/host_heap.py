"""The process's heap as a prompt uses it (glibc's malloc; elsewhere nothing is changed).

A prompt chunk's forward allocates and frees tens of tensors of a few to tens of MiB on the engine
thread. With glibc's defaults each thread's heap is at most 64 MiB and is unmapped once empty,
the largest blocks are mmapped and unmapped each time, and a heap's free top beyond the trim
threshold goes back to the kernel: so every chunk faulted in and zeroed much of its memory again
(62-255 thousand page faults a 512-token prompt on an AMD EPYC VM, 2 threads; one 4 KiB fault costs
a VM more than a bare machine). `keep_freed_memory` makes every thread allocate from the main heap
(one arena), blocks of up to 32 MiB (glibc's most) from it too, and keeps up to KEPT_BYTES of its
free top: the prompt's pages are mapped once and reused (where the main heap can grow in place), at most KEPT_BYTES more resident than
glibc's defaults leave after a prompt. Blocks of 32 MiB or more are still mapped per allocation; the
native layer call keeps its own (kernels/scratch.h). Measured: bench/results/host-heap-round40-*.txt.

Applied when moefit is imported, unless the user set glibc's malloc tunables themselves
(GLIBC_TUNABLES with a glibc.malloc entry, or MALLOC_ARENA_MAX, MALLOC_MMAP_THRESHOLD_,
MALLOC_TRIM_THRESHOLD_) or MOEFIT_HEAP=default.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8     # glibc's malloc.h
MMAP_MOST = 32 << 20                     # glibc's largest mmap threshold on 64-bit (HEAP_MAX_SIZE / 2)
KEPT_BYTES = 256 << 20
USER_SETTINGS = ("MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def glibc() -> bool:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")
    except (ValueError, OSError, AttributeError):
        return False


def user_chose() -> bool:
    """Whether the user set malloc's behaviour (or asked for glibc's defaults)."""
    return (os.environ.get("MOEFIT_HEAP") == "default" or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", "")
            or any(name in os.environ for name in USER_SETTINGS))


def keep_freed_memory() -> bool:
    """The settings above, where this is glibc and the user chose none; whether they were made."""
    if user_chose() or not glibc():
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return all(libc.mallopt(option, value) == 1 for option, value in (
            (M_ARENA_MAX, 1), (M_MMAP_THRESHOLD, MMAP_MOST), (M_TRIM_THRESHOLD, KEPT_BYTES)))
    except (OSError, AttributeError):
        return False

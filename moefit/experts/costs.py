"""PCIe or host: where a missed expert of a multi-token step (a prefill chunk, a verify
window) is cheaper to run.

A miss computed on the host reads its weights once and does rows x its MACs:
    host_s = blob_bytes / host_bytes_per_s + rows * macs / host_macs_per_s
with the integer dots' rates, or, for an expert a prompt chunk makes busy (experts/groups.py:
two fp32 GEMMs on its matrices dequantised first), the GEMM path's own two:
    host_s = blob_bytes / gemm_bytes_per_s + rows * macs / gemm_macs_per_s
A miss copied into a free or evictable slot over PCIe (from the pack's pages) is admitted
and then runs on the device, whose time is small next to either (not counted):
    pcie_s = blob_bytes / pcie_bytes_per_s
Copying wins when pcie_s < host_s: at decode (one row) the host wins on a 12 GB card's PCIe,
for a prefill chunk that routes dozens of rows to an expert the copy does. The rates are
measured at start (host: one native call on a real expert; PCIe: a pinned copy to the card)
or given (--pcie-gbps, --host-expert-gbps); with no PCIe rate (a simulated card, unless
given) nothing is copied. Both paths give the same numbers: the copied expert runs from its
slot as any resident one does.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch


@dataclass
class MissCosts:
    pcie_bytes_per_s: float = 0.0            # 0: never copy
    host_bytes_per_s: float = 20e9
    host_macs_per_s: float = 100e9
    gemm_bytes_per_s: float = 5e9            # a busy expert's: dequantising its blob first ...
    gemm_macs_per_s: float = 200e9           # ... then fp32 GEMMs

    @property
    def enabled(self) -> bool:
        return self.pcie_bytes_per_s > 0

    def copy_is_cheaper(self, blob_bytes: int, rows: int, macs_per_row: int, gemm: bool = False) -> bool:
        """Whether copying the miss over PCIe beats computing it on the host (gemm: as a busy expert)."""
        bw, macs = ((self.gemm_bytes_per_s, self.gemm_macs_per_s) if gemm
                    else (self.host_bytes_per_s, self.host_macs_per_s))
        host = blob_bytes / bw + rows * macs_per_row / macs
        return self.enabled and blob_bytes / self.pcie_bytes_per_s < host

    def to_json(self) -> dict:
        return {"pcie_gbps": self.pcie_bytes_per_s / 1e9, "host_expert_gbps": self.host_bytes_per_s / 1e9,
                "host_expert_gmacs": self.host_macs_per_s / 1e9, "host_gemm_gbps": self.gemm_bytes_per_s / 1e9,
                "host_gemm_gmacs": self.gemm_macs_per_s / 1e9}


def measure_pcie(device: torch.device, nbytes: int = 64 << 20) -> float:
    """Host-to-device bytes per second from pinned memory (best of 3)."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del dst
    return nbytes / best


def measure_host(run_one, blob_bytes: int, macs_per_row: int, rows: int = 64, first: int = 1) -> tuple[float, float]:
    """(bytes/s, MACs/s) of the host path from two timed calls of run_one(n) on one expert: `first`
    rows and `rows` rows; the time a row more is the compute, what is left at `first` the fixed
    cost (the weights streamed; for the GEMM path, with both counts a busy expert's, also their
    dequantisation)."""
    def timed(n: int) -> float:
        run_one(n)
        t = time.perf_counter()
        run_one(n)
        return time.perf_counter() - t
    one, many = timed(first), timed(rows)
    per_row = max(1e-9, (many - one) / (rows - first))
    fixed = max(one - first * per_row, 1e-9)
    return blob_bytes / fixed, macs_per_row / per_row


NEVER = 1 << 30          # rows no prompt chunk reaches: the integer dots always


def crossover(time_one, low: int = 16, high: int = 96, repeats: int = 5, margin: float = 0.1) -> int:
    """The rows from which a prompt chunk's expert is faster as fp32 GEMMs than as the integer dots
    on this machine: time_one(rows, gemm) at `low` and `high` rows for both (interleaved, best of
    `repeats`: this machine's timings move by 20 % from call to call), each path a line through its
    two points, and the rows where the GEMMs' line falls `margin` below the dots' (NEVER when it
    does not by 4 x high). Measured on two machines (bench/prefill_gemm.py, a Q4_K_M pack, 512-token
    prompt): on an Intel Xeon (2 hyperthreads) the experts' GEMMs from 24 rows made the prompt
    1.28x faster; on an AMD EPYC (Zen 5, 2 cores) 0.75-0.89x (the pool and torch's threads taking
    turns there costs more than the GEMMs save), and auto there 0.95x of all dots."""
    t: dict = {}
    for _ in range(repeats):
        for n in (low, high):
            for gemm in (False, True):
                t[n, gemm] = min(t.get((n, gemm), math.inf), time_one(n, gemm))
    dots = {n: (1 - margin) * t[n, False] for n in (low, high)}
    slope_dots, slope_gemm = (dots[high] - dots[low]) / (high - low), (t[high, True] - t[low, True]) / (high - low)
    if slope_gemm >= slope_dots:
        return NEVER
    rows = low + (t[low, True] - dots[low]) / (slope_dots - slope_gemm)
    return max(low, math.ceil(rows)) if rows <= 4 * high else NEVER

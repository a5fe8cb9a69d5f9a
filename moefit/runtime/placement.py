"""Putting tensors on the device, with every byte charged to a named ledger line.

On a simulated card tensors live in host memory but are charged to the card; on CUDA
an out-of-memory error becomes DeviceOutOfMemory, so the engine handles both alike.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from moefit.errors import DeviceOutOfMemory, DeviceUnavailable
from moefit.memory.devices import Device, DeviceSnapshot


class DeviceMemory:
    """Usage: mem = DeviceMemory(device); kv = mem.empty("KV cache", (L, T), torch.int8)"""

    def __init__(self, device: Device):
        self.device = device
        self.torch_device = torch.device(f"cuda:{device.index}" if device.kind == "cuda" else "cpu")
        self.charged: dict[str, int] = defaultdict(int)

    def empty(self, line: str, shape, dtype: torch.dtype) -> torch.Tensor:
        nbytes = _numel(shape) * torch.empty((), dtype=dtype).element_size()
        self._charge(line, nbytes)
        try:
            return torch.empty(shape, dtype=dtype, device=self.torch_device)
        except torch.OutOfMemoryError:
            self.charged[line] -= nbytes
            raise DeviceOutOfMemory(f"CUDA out of memory allocating {line} ({nbytes / 2**20:.1f} MiB)") from None

    def copy_in(self, line: str, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        out = self.empty(line, t.shape, dtype or t.dtype)
        out.copy_(t, non_blocking=True)
        return out

    def free(self, line: str, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        self.charged[line] -= nbytes
        if self.device.kind == "sim":
            self.device.sim.release(nbytes)

    def _charge(self, line: str, nbytes: int) -> None:
        if self.device.kind == "sim":
            self.device.sim.charge(nbytes, line)
        self.charged[line] += nbytes

    def check_fits(self) -> None:
        """Called before each forward: a simulated card that another program overfilled
        fails here like a CUDA allocation would."""
        if self.device.kind == "sim":
            self.device.sim.check_fits()

    def release_cached(self) -> None:
        """Hand freed blocks back to the driver so other programs (and NVML) see them."""
        if self.device.kind == "cuda":
            torch.cuda.empty_cache()

    def total_charged(self) -> int:
        return sum(self.charged.values())

    def snapshot(self) -> DeviceSnapshot:
        return device_snapshot(self.device)


def device_snapshot(device: Device) -> DeviceSnapshot:
    """The device's snapshot; on CUDA without NVML, torch's mem_get_info (no process list)."""
    try:
        return device.snapshot()
    except DeviceUnavailable:
        if device.kind != "cuda" or not torch.cuda.is_available():
            raise
    free, total = torch.cuda.mem_get_info(device.index)
    return DeviceSnapshot(torch.cuda.get_device_name(device.index), total, free, (), "", "torch")


def _numel(shape) -> int:
    n = 1
    for d in (shape if isinstance(shape, (tuple, list, torch.Size)) else (shape,)):
        n *= d
    return n

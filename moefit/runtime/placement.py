"""Putting tensors on the device, with every byte charged to a named ledger line.

On a simulated card tensors live in host memory but are charged to the card by its
allocator model; on CUDA an out-of-memory error becomes DeviceOutOfMemory, so the engine
handles both alike. A line is charged what memory_allocated would count (512-byte blocks
under the CUDA allocator), so the ledger compares with torch's own figures.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from moefit.errors import DeviceOutOfMemory, DeviceUnavailable
from moefit.memory.allocator import block_bytes
from moefit.memory.devices import Device, DeviceSnapshot


class DeviceMemory:
    """Usage: mem = DeviceMemory(device); kv = mem.empty("KV cache", (L, T), torch.int8)"""

    def __init__(self, device: Device):
        self.device = device
        self.torch_device = torch.device(f"cuda:{device.index}" if device.kind == "cuda" else "cpu")
        self.charged: dict[str, int] = defaultdict(int)
        self._handles: dict[int, int] = {}        # a simulated card's allocation handle, by data_ptr
        self.rounds = device.kind == "cuda" or (device.kind == "sim" and device.sim.allocator.model == "cuda")

    def empty(self, line: str, shape, dtype: torch.dtype) -> torch.Tensor:
        nbytes = _numel(shape) * torch.empty((), dtype=dtype).element_size()
        handle = self._charge(line, nbytes)
        try:
            t = torch.empty(shape, dtype=dtype, device=self.torch_device)
        except torch.OutOfMemoryError:
            self.charged[line] -= self.block(nbytes) if nbytes else 0
            raise DeviceOutOfMemory(f"CUDA out of memory allocating {line} ({nbytes / 2**20:.1f} MiB)") from None
        if handle is not None:
            self._handles[t.data_ptr()] = handle
        return t

    def cost(self, nbytes: int) -> int:
        """How much the card's free memory drops if nbytes are allocated now."""
        if self.device.kind == "sim":
            return self.device.sim.allocator.cost(nbytes)
        return self.block(nbytes)

    def block(self, nbytes: int) -> int:
        """What an allocation of nbytes counts for (torch.cuda.memory_allocated's rounding)."""
        return block_bytes(nbytes) if self.rounds else nbytes

    def copy_in(self, line: str, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        out = self.empty(line, t.shape, dtype or t.dtype)
        out.copy_(t, non_blocking=True)
        return out

    def free(self, line: str, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        self.charged[line] -= self.block(nbytes) if nbytes else 0
        handle = self._handles.pop(t.data_ptr(), None)
        if handle is not None:
            self.device.sim.release(handle)

    def _charge(self, line: str, nbytes: int) -> int | None:
        if nbytes == 0:                           # torch allocates nothing for an empty tensor
            return None
        handle = self.device.sim.charge(nbytes, line) if self.device.kind == "sim" else None
        self.charged[line] += self.block(nbytes)
        return handle

    def check_fits(self) -> None:
        """Called before each forward: a simulated card that another program overfilled
        fails here like a CUDA allocation would."""
        if self.device.kind == "sim":
            self.device.sim.check_fits()

    def release_cached(self) -> None:
        """Hand freed blocks back to the driver so other programs (and NVML) see them."""
        if self.device.kind == "cuda":
            torch.cuda.empty_cache()
        elif self.device.kind == "sim":
            self.device.sim.empty_cache()

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

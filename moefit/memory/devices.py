"""Device snapshots: name, total, free, and who holds memory. No torch here.

Sources:  sim:CARD.json  a simulated card, re-read at every snapshot
          cuda[:N]       NVML (nvidia-ml-py); torch's mem_get_info where NVML is missing
          cpu            host memory only: no VRAM, nothing to plan
"""

from __future__ import annotations

import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from moefit.errors import DeviceUnavailable

MIB = 1 << 20


@dataclass(frozen=True)
class ProcessUsage:
    pid: int
    name: str
    bytes: int


@dataclass(frozen=True)
class DeviceSnapshot:
    name: str
    total_bytes: int
    free_bytes: int
    processes: tuple[ProcessUsage, ...] = ()
    uuid: str = ""
    source: str = ""
    unattributed_bytes: int = 0   # used, but held by no listed process (released late)

    @property
    def used_bytes(self) -> int:
        return self.total_bytes - self.free_bytes

    def to_json(self) -> dict:
        d = asdict(self)
        d["processes"] = [asdict(p) for p in self.processes]
        return d

    @staticmethod
    def from_json(d: dict) -> "DeviceSnapshot":
        procs = tuple(ProcessUsage(p["pid"], p["name"], p["bytes"]) for p in d.get("processes", []))
        return DeviceSnapshot(d["name"], d["total_bytes"], d["free_bytes"], procs,
                              d.get("uuid", ""), d.get("source", ""), d.get("unattributed_bytes", 0))


@dataclass
class Device:
    """Where moefit allocates. `snapshot()` reads the card now."""

    spec: str
    kind: str                                  # "cpu" | "cuda" | "sim"
    index: int = 0
    sim: object = field(default=None, repr=False)          # a SimCard when kind == "sim"

    @property
    def has_vram(self) -> bool:
        return self.kind != "cpu"

    def snapshot(self) -> DeviceSnapshot:
        if self.kind == "sim":
            return self.sim.snapshot()
        if self.kind == "cuda":
            return nvml_snapshot(self.index)
        raise DeviceUnavailable("the cpu device has no VRAM to snapshot")


def open_device(spec: str) -> Device:
    """Parse --device: cpu, cuda, cuda:N, sim:FILE."""
    from moefit.memory.simcard import SimCard
    if spec == "cpu":
        return Device(spec, "cpu")
    if spec.startswith("sim:"):
        return Device(spec, "sim", sim=SimCard(Path(spec[4:])))
    if spec == "cuda" or spec.startswith("cuda:"):
        return Device(spec, "cuda", int(spec.split(":")[1]) if ":" in spec else 0)
    raise DeviceUnavailable(f"unknown device {spec!r} (use cpu, cuda, cuda:N or sim:CARD.json)")


def nvml_snapshot(index: int) -> DeviceSnapshot:
    """Snapshot of an NVIDIA card through NVML, with its processes."""
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception as e:  # noqa: BLE001 - NVML raises its own error types, or ImportError
        raise DeviceUnavailable(f"NVML is not available ({type(e).__name__}: {e}); no NVIDIA driver on "
                                "this machine? Use --device sim:CARD.json to simulate a card") from None
    handle = _nvml_handle(pynvml, index)
    mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
    procs = _nvml_processes(pynvml, handle)
    name = pynvml.nvmlDeviceGetName(handle)
    uuid = pynvml.nvmlDeviceGetUUID(handle)
    held = sum(p.bytes for p in procs)
    return DeviceSnapshot(_text(name), mem.total, mem.free, tuple(procs), _text(uuid), "nvml",
                          max(0, mem.used - held))


def _nvml_handle(pynvml, index: int):
    """NVML's handle of CUDA device `index`. CUDA numbers devices fastest first and after
    CUDA_VISIBLE_DEVICES, NVML by PCI bus over all of them: the two indices agree only by
    chance, so the device is found by its UUID (a MIG instance's own, where it is one)."""
    for uuid in cuda_uuids(index):
        try:
            return pynvml.nvmlDeviceGetHandleByUUID(uuid)
        except Exception:  # noqa: BLE001 - NVMLError_NotFound and kin
            continue
    visible = visible_devices()
    if visible is not None and index < len(visible) and visible[index].isdigit():
        return pynvml.nvmlDeviceGetHandleByIndex(int(visible[index]))
    return pynvml.nvmlDeviceGetHandleByIndex(index)


def visible_devices() -> list[str] | None:
    """CUDA_VISIBLE_DEVICES as a list (indices, GPU-/MIG- UUIDs), or None when unset."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    return None if value is None else [v.strip() for v in value.split(",") if v.strip()]


def cuda_uuids(index: int) -> list[str]:
    """The UUIDs NVML may know CUDA device `index` by: what CUDA_VISIBLE_DEVICES names there,
    and, where torch has already started CUDA, the device's own UUID as GPU- and MIG-."""
    out = []
    visible = visible_devices()
    if visible is not None and index < len(visible) and not visible[index].isdigit():
        out.append(visible[index])
    torch = sys.modules.get("torch")              # this module stays torch-free: use it only if loaded
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        uuid = str(torch.cuda.get_device_properties(index).uuid)
        out += [uuid if uuid.startswith(("GPU-", "MIG-")) else f"{prefix}-{uuid}" for prefix in ("GPU", "MIG")]
    return out


def _nvml_processes(pynvml, handle) -> list[ProcessUsage]:
    seen: dict[int, int] = {}
    for getter in (pynvml.nvmlDeviceGetComputeRunningProcesses, pynvml.nvmlDeviceGetGraphicsRunningProcesses):
        for p in getter(handle):
            seen[p.pid] = max(seen.get(p.pid, 0), p.usedGpuMemory or 0)
    return [ProcessUsage(pid, process_name(pid), used) for pid, used in sorted(seen.items())]


def host_available_bytes() -> int | None:
    """RAM the kernel says is available (MemAvailable), or None where /proc/meminfo is absent."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def process_name(pid: int) -> str:
    """The command name of pid, with 'moefit' kept visible when it runs under python."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"
    if any(b"moefit" in part for part in cmdline):
        return "moefit"
    return comm


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)

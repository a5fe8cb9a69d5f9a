"""Finding the NVML device behind a CUDA index: CUDA_VISIBLE_DEVICES and MIG."""

import types

import pytest

from moefit.memory import devices


class FakeNVML(types.SimpleNamespace):
    """Two cards, PCI order; a MIG instance on the second."""

    def __init__(self):
        super().__init__(calls=[])

    def nvmlDeviceGetHandleByIndex(self, i):
        self.calls.append(("index", i))
        return f"card{i}"

    def nvmlDeviceGetHandleByUUID(self, uuid):
        self.calls.append(("uuid", uuid))
        if uuid not in ("GPU-1111", "MIG-2222"):
            raise LookupError(uuid)
        return uuid


@pytest.mark.parametrize("visible, index, handle", [
    (None, 1, "card1"),                  # nothing hidden: the same index
    ("1,0", 0, "card1"),                 # CUDA's device 0 is NVML's 1
    ("MIG-2222", 0, "MIG-2222"),         # a MIG instance, by its UUID
    ("GPU-1111,1", 1, "card1"),
    ("GPU-1111,1", 0, "GPU-1111"),
])
def test_the_nvml_handle_follows_cuda_visible_devices(visible, index, handle, monkeypatch):
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert devices._nvml_handle(FakeNVML(), index) == handle

"""The device's copy of the expert cache's addresses: (layer, expert) -> where its blob's slot
starts, 0 where the expert is not on the card. The fused expert kernels (kernels/device_moe.py)
read it beside the router's ids, so a layer's resident experts are queued before the host
knows the routing.

    table = SlotTable(mem.empty(L.DENSE, (layers, experts), torch.int64))
    table.place(key, view)            # the slot's expert is resident (host side, marks the layer)
    table.drop(key)                   # ... gone
    row = table.row(layer)            # the layer's row on the device, sent first if it changed
    held = table.held(layer)          # which of its experts that row holds (the host's copy)

The host keeps the truth; a layer's row goes down (one small non-blocking copy from pinned
memory, ordered on the compute stream) only when it changed since it last went. Addresses are
bytes from `base` (the table itself) inside the kernels, so one pointer reaches every chunk
of the pool. It is held in the dense line (memory/footprint.py: slot_table_bytes).
"""

from __future__ import annotations

import numpy as np
import torch

from moefit.experts.cache import Key


class SlotTable:
    def __init__(self, device_table: torch.Tensor):
        self.device = device_table.zero_()
        self.host = np.zeros(tuple(device_table.shape), dtype=np.int64)
        self._stale: set[int] = set()                # layers whose device row is behind the host's
        self.sent = 0                                # rows copied down (a counter for the tests)

    @property
    def base(self) -> torch.Tensor:
        """The tensor the kernels' byte offsets count from."""
        return self.device.view(torch.uint8)

    def place(self, key: Key, view: torch.Tensor) -> None:
        self.host[key] = view.data_ptr()
        self._stale.add(key[0])

    def drop(self, key: Key) -> None:
        if self.host[key]:
            self.host[key] = 0
            self._stale.add(key[0])

    def held(self, layer: int) -> np.ndarray:
        """bool [experts]: the experts of `layer` the device's row has a slot for."""
        return self.host[layer] != 0

    def full(self, layer: int) -> bool:
        """Every expert of `layer` has a slot (False for a layer index out of range: none guessed)."""
        return 0 <= layer < self.host.shape[0] and bool(self.host[layer].all())

    def row(self, layer: int) -> torch.Tensor:
        if layer in self._stale:
            self._stale.discard(layer)
            src = torch.from_numpy(self.host[layer].copy())
            if self.device.is_cuda:            # from torch's caching host allocator: kept until the copy ran
                src = src.pin_memory()
            self.device[layer].copy_(src, non_blocking=True)
            self.sent += 1
        return self.device[layer]

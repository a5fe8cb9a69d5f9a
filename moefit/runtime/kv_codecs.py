"""How key and value rows are stored: one codec per KV dtype (families/state.py's table).

    float   the rows in fp32 / fp16 / bf16
    int8    int8 codes + one fp32 scale per row
    q4      the row rotated by a fixed orthonormal matrix (a Hadamard matrix when the head
            dim is a power of two), then 4-bit codes + one fp16 scale per 32 values. The
            rotation spreads outlier channels over the row so that 4 bits hold it; since it is
            orthonormal, attention is computed on rotated rows exactly as on plain ones
            (q.k = qR.kR, and P.(VR) R^T = P.V), so rows are never rotated back.

A store is a dict of tensors [K, C, ...] (K heads, C positions); `put` writes positions,
`get` returns rows in the compute dtype (rotated for q4: see `rotation`). A StoredRows names a
store's first rows as they are: the host's native attention (kernels/kv.h) reads them so, by the
codec's `native` number, and anything else decodes them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moefit.families.state import Q4_GROUP

FLOAT = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def rotation_matrix(d: int) -> torch.Tensor:
    """An orthonormal [d, d]: Sylvester's Hadamard / sqrt(d) for a power of two, else a fixed
    random rotation (QR of a seeded Gaussian)."""
    if d & (d - 1) == 0:
        h = torch.ones(1, 1)
        while h.shape[0] < d:
            h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
        return h / math.sqrt(d)
    g = torch.Generator().manual_seed(d)
    q, r = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).float()


class FloatRows:
    rotation = None

    def __init__(self, kv_dtype: str, d: int):
        self.dtype, self.d = FLOAT[kv_dtype], d
        self.native = ("fp32", "fp16", "bf16").index(kv_dtype)          # kernels/kv.h's codec

    def empty(self, alloc, k: int, c: int) -> dict:
        return {"x": alloc((k, c, self.d), self.dtype)}

    def put(self, store: dict, index, x: torch.Tensor) -> None:
        store["x"][:, index] = x.to(self.dtype)      # index_put (a ring's slots) does not convert

    def get(self, store: dict, index, dtype) -> torch.Tensor:
        return store["x"][:, index].to(dtype)


class Int8Rows(FloatRows):
    native = 3

    def __init__(self, d: int):
        self.d = d

    def empty(self, alloc, k: int, c: int) -> dict:
        return {"x": alloc((k, c, self.d), torch.int8), "s": alloc((k, c, 1), torch.float32)}

    def put(self, store: dict, index, x: torch.Tensor) -> None:
        scale = x.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-8) / 127.0
        store["x"][:, index] = torch.round(x.float() / scale).clamp(-127, 127).to(torch.int8)
        store["s"][:, index] = scale

    def get(self, store: dict, index, dtype) -> torch.Tensor:
        return store["x"][:, index].to(dtype) * store["s"][:, index].to(dtype)


class Q4Rows(FloatRows):
    native = 4

    def __init__(self, d: int):
        if d % Q4_GROUP:
            raise ValueError(f"--kv-dtype q4 needs a head dim divisible by {Q4_GROUP} (this model's is {d})")
        self.d, self.rotation = d, rotation_matrix(d)

    def empty(self, alloc, k: int, c: int) -> dict:
        return {"x": alloc((k, c, self.d // 2), torch.uint8), "s": alloc((k, c, self.d // Q4_GROUP), torch.float16)}

    def put(self, store: dict, index, x: torch.Tensor) -> None:
        if store["x"].is_cpu and _native_put(self, store, index, x):
            return
        r = self.rotation.to(x.device)
        groups = (x.float() @ r).unflatten(-1, (-1, Q4_GROUP))                         # [K, T, G, 32]
        scale = (groups.abs().amax(dim=-1, keepdim=True) / 7.0).clamp(min=1e-8)
        codes = (torch.round(groups / scale).clamp(-8, 7) + 8).to(torch.uint8).flatten(-2)   # [K, T, D]
        store["x"][:, index] = codes[..., 0::2] | (codes[..., 1::2] << 4)
        store["s"][:, index] = scale.squeeze(-1).to(torch.float16)

    def get(self, store: dict, index, dtype) -> torch.Tensor:
        packed = store["x"][:, index]
        codes = torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2).to(dtype) - 8      # [K, S, D]
        scale = store["s"][:, index].to(dtype).repeat_interleave(Q4_GROUP, dim=-1)
        return codes * scale


def _native_put(codec: FloatRows, store: dict, index, x: torch.Tensor) -> bool:
    """One position's host rows written by kernels/kv.h's writer, the one the native decode step
    writes with, so a step taken op by op codes its row as the one call does (q4 turns rows by a
    matrix product, whose sums torch and the kernel order differently). A prompt's rows go
    through torch's matrix product: the kernel's loop would cost a 512-token chunk ~10 ms a layer."""
    if x.shape[1] != 1:
        return False
    from moefit.kernels.rows import kv_put
    capacity = store["x"].shape[1]
    positions = torch.arange(capacity)[index] if isinstance(index, slice) else torch.as_tensor(index).reshape(-1)
    return kv_put(StoredRows(codec, store, capacity), positions, x)


def codec(dtype: str, d: int):
    if dtype == "int8":
        return Int8Rows(d)
    if dtype == "q4":
        return Q4Rows(d)
    return FloatRows(dtype, d)


@dataclass(frozen=True)
class StoredRows:
    """Rows offset..offset+count of a store [K, C, ...] (positions 0..count of a whole-context store;
    a run of a ring's slots), not decoded: models/attention.py hands them to the host's native
    attention as they are, or decodes them (`decode`) where that cannot take them."""
    codec: FloatRows
    store: dict
    count: int
    offset: int = 0

    def decode(self, dtype: torch.dtype, start: int = 0) -> torch.Tensor:
        """Rows start..count of these, in dtype."""
        return self.codec.get(self.store, slice(self.offset + start, self.offset + self.count), dtype)

    def first(self, count: int) -> "StoredRows":
        return StoredRows(self.codec, self.store, count, self.offset)

    @property
    def device(self) -> torch.device:
        return self.store["x"].device

"""A GGUF file's metadata and tensors (llama.cpp's format, versions 2 and 3), read in one pass.

gguf-py's GGUFReader makes a numpy view of every item of every array: a 151,936-token vocabulary
and its merges are ~1.1 million views, 15-28 s on this project's machines before `moefit pack`
does anything. Here a string array is read with `struct` from the mapped bytes and a number array
is one `np.frombuffer`, so the same metadata takes a fraction of a second; the tensors are what
GGUFReader gives (name, `GGMLQuantizationType`, dims innermost first, a read-only view of the
mapped file shaped as gguf-py shapes it), so gguf.quants dequantises them as before.

    f = GGUFFile("model.gguf"); f.meta["general.architecture"]; f.tensors[0].data
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quant_shape_to_byte_shape

MAGIC = b"GGUF"
VERSIONS = (2, 3)
STRING, ARRAY = 8, 9
NUMBERS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
           12: "<d"}                # GGUF value type -> its little-endian layout (struct's codes, numpy's too)
ITEMS = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
         GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8, GGMLQuantizationType.I16: np.int16,
         GGMLQuantizationType.I32: np.int32, GGMLQuantizationType.I64: np.int64}   # the rest: bytes of blocks
DEFAULT_ALIGNMENT = 32


@dataclass
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray                                    # dims, innermost first (as the file lists them)
    data: np.ndarray                                     # a view of the mapped file


class GGUFFile:
    def __init__(self, path: Path | str):
        self.path = Path(path)
        self.data = np.memmap(self.path, mode="r")
        self._buf = memoryview(self.data)
        if bytes(self._buf[:4]) != MAGIC:
            raise ValueError("GGUF magic invalid")
        self._at = 4
        version, tensors, kvs = self._unpack("<I"), self._unpack("<Q"), self._unpack("<Q")
        if version not in VERSIONS:
            raise ValueError(f"GGUF version {version} (byte-swapped or unknown) is not one of {VERSIONS}")
        self.meta: dict[str, object] = {}
        for _ in range(kvs):
            key = self._string()
            self.meta[key] = self._value(self._unpack("<I"))
        infos = [self._tensor_info() for _ in range(tensors)]
        align = self.meta.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise ValueError(f"invalid general.alignment {align!r}: must be a power of two")
        start = -(-self._at // align) * align
        self.tensors = [self._tensor(start, *info) for info in infos]
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError("duplicated tensor names")

    # -- the metadata -------------------------------------------------------------
    def _unpack(self, fmt: str):
        value, = struct.unpack_from(fmt, self._buf, self._at)
        self._at += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._unpack("<Q")
        text = str(self._buf[self._at:self._at + n], encoding="utf-8")
        self._at += n
        return text

    def _value(self, kind: int):
        if kind == STRING:
            return self._string()
        if kind in NUMBERS:
            return self._unpack(NUMBERS[kind])
        if kind != ARRAY:
            raise ValueError(f"unknown GGUF value type {kind}")
        item, count = self._unpack("<I"), self._unpack("<Q")
        if item in NUMBERS:                                # one read for the whole array
            values = np.frombuffer(self._buf, dtype=NUMBERS[item], count=count, offset=self._at)
            self._at += values.nbytes
            return values.tolist()
        return [self._value(item) for _ in range(count)]   # strings (or nested arrays)

    # -- the tensors --------------------------------------------------------------
    def _tensor_info(self) -> tuple:
        name, dims = self._string(), self._unpack("<I")
        shape = np.frombuffer(self._buf, dtype="<u8", count=dims, offset=self._at).copy()
        self._at += 8 * dims
        kind = GGMLQuantizationType(self._unpack("<I"))
        return name, shape, kind, self._unpack("<Q")

    def _tensor(self, start: int, name: str, shape: np.ndarray, kind: GGMLQuantizationType, offset: int) -> GGUFTensor:
        block, size = GGML_QUANT_SIZES[kind]
        dims = tuple(reversed(shape.tolist()))
        n_bytes = int(np.prod(shape)) * size // block
        item = ITEMS.get(kind, np.uint8)
        if item is np.uint8:
            dims = quant_shape_to_byte_shape(dims, kind)
        at = start + offset
        if at + n_bytes > len(self.data):
            raise ValueError(f"tensor {name} runs past the end of the file")
        return GGUFTensor(name, kind, shape, self.data[at:at + n_bytes].view(item).reshape(dims))

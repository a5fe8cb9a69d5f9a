"""The native pack: a directory with a versioned header, the dense weights, one
contiguous blob per (layer, expert), the tokenizer, and (once profiled) the profile.

    PACK/moefit-pack.json   header: format version, family, model config, quant recipe,
                            dense index, expert index (offset, bytes, layout, crc32)
    PACK/dense.bin          dense tensors, 64-byte aligned
    PACK/experts.bin        expert blobs, 4096-byte aligned
    PACK/tokenizer/         tokenizer.json, tokenizer_config.json, chat_template.jinja
    PACK/profile.json       routing counts per (layer, expert), written atomically

Opening maps the two weight files (no copy in RAM) and verifies sizes and checksums (the
checksums once while the files stay the same: pack/verified.py), raising PackError that names
the file and, for a bad blob, the (layer, expert).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

from moefit.errors import PackError
from moefit.pack.layout import BLOB_ALIGN, PART_ALIGN, Part, align

FORMAT = "moefit-pack"
FORMAT_VERSION = 1
HEADER = "moefit-pack.json"
DENSE = "dense.bin"
EXPERTS = "experts.bin"
TOKENIZER_DIR = "tokenizer"


@dataclass(frozen=True)
class BlobEntry:
    layer: int
    expert: int
    offset: int
    nbytes: int
    quant: str
    crc32: int


class PackWriter:
    """Appends dense tensors and expert blobs; `finish` writes the header last, so a
    pack whose conversion died has no header and cannot be opened by mistake."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / HEADER).unlink(missing_ok=True)
        self.dense_f = open(self.path / DENSE, "wb")
        self.experts_f = open(self.path / EXPERTS, "wb")
        self.dense: dict[str, dict] = {}
        self.blobs: list[BlobEntry] = []

    def add_dense(self, name: str, data: bytes, dtype: str, shape: tuple[int, ...]) -> None:
        offset = _pad_to(self.dense_f, PART_ALIGN)
        self.dense_f.write(data)
        self.dense[name] = {"offset": offset, "nbytes": len(data), "dtype": dtype,
                            "shape": list(shape), "crc32": zlib.crc32(data)}

    def add_blob(self, layer: int, expert: int, quant: str, parts: list[tuple[Part, bytes]]) -> None:
        offset = _pad_to(self.experts_f, BLOB_ALIGN)
        blob = bytearray(parts[-1][0].offset + len(parts[-1][1]))
        for part, data in parts:
            blob[part.offset:part.offset + len(data)] = data
        blob.extend(bytes(align(len(blob), PART_ALIGN) - len(blob)))
        self.experts_f.write(blob)
        self.blobs.append(BlobEntry(layer, expert, offset, len(blob), quant, zlib.crc32(blob)))

    def finish(self, header: dict) -> dict:
        self.dense_f.close()
        self.experts_f.close()
        header = dict(header, format=FORMAT, format_version=FORMAT_VERSION,
                      dense={"file": DENSE, "tensors": self.dense},
                      experts={"file": EXPERTS, "layouts": header["experts_layouts"],
                               "index": [list(b.__dict__.values()) for b in self.blobs]})
        header.pop("experts_layouts")
        header["pack_id"] = hashlib.sha256(json.dumps(header, sort_keys=True).encode()).hexdigest()[:16]
        write_json_atomic(self.path / HEADER, header)
        return header


def _pad_to(f, alignment: int) -> int:
    pos = f.tell()
    target = align(pos, alignment)
    f.write(bytes(target - pos))
    return target


def write_json_atomic(path: Path, obj) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def read_header(path: Path) -> dict:
    file = Path(path) / HEADER
    if not file.exists():
        raise PackError(f"{path}: not a moefit pack ({HEADER} is missing; was the conversion interrupted?)")
    try:
        header = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PackError(f"{file}: the header is not valid JSON ({e})") from None
    if header.get("format") != FORMAT:
        raise PackError(f"{file}: not a moefit pack header")
    if header.get("format_version") != FORMAT_VERSION:
        raise PackError(f"{file}: pack format version {header.get('format_version')} is not supported "
                        f"(this moefit reads version {FORMAT_VERSION}); re-run `moefit pack`")
    return header


def map_file(file: Path) -> mmap.mmap:
    """Private (copy-on-write) map: torch can view it without copying; we never write."""
    with open(file, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return mmap.mmap(-1, 1)
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)


def verify_dense(file: Path, data: mmap.mmap, tensors: dict, checksums: bool) -> None:
    for name, t in tensors.items():
        end = t["offset"] + t["nbytes"]
        if end > len(data):
            raise PackError(f"{file}: truncated ({len(data)} bytes; tensor {name} ends at {end})")
        if checksums and zlib.crc32(memoryview(data)[t["offset"]:end]) != t["crc32"]:
            raise PackError(f"{file}: tensor {name} fails its checksum (the file is corrupt)")


def verify_blobs(file: Path, data: mmap.mmap, blobs: list[BlobEntry], checksums: bool) -> None:
    for b in blobs:
        end = b.offset + b.nbytes
        if end > len(data):
            raise PackError(f"{file}: truncated ({len(data)} bytes; blob (layer {b.layer}, "
                            f"expert {b.expert}) ends at {end})")
        if checksums and zlib.crc32(memoryview(data)[b.offset:end]) != b.crc32:
            raise PackError(f"{file}: blob (layer {b.layer}, expert {b.expert}) fails its checksum "
                            "(the file is corrupt)")


def parse_layouts(raw: dict) -> dict[str, list[Part]]:
    return {q: [Part(p["name"], p["dtype"], tuple(p["shape"]), p["offset"]) for p in parts]
            for q, parts in raw.items()}


def layout_json(parts: list[Part]) -> list[dict]:
    return [{"name": p.name, "dtype": p.dtype, "shape": list(p.shape), "offset": p.offset} for p in parts]

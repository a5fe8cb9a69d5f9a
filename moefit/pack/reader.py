"""Open a pack: map it, verify it, and hand out tensors that view the map (no copy)."""

from __future__ import annotations

import json
import mmap
import time
import warnings
from pathlib import Path

import torch

from moefit.config import ModelConfig
from moefit.errors import PackError
from moefit.pack import format as fmt
from moefit.pack import verified
from moefit.pack.quant import TORCH_DTYPES, blob_views


class Pack:
    """A verified, memory-mapped pack.

    Usage: pack = Pack.open("qwen.pack"); w = pack.dense("model.norm.weight")
    """

    def __init__(self, path: Path, header: dict, dense_map, experts_map):
        self.path = Path(path)
        self.header = header
        self.model = ModelConfig.from_hf(header["model_config"])
        self.quant = header["quant"]
        self.layouts = fmt.parse_layouts(header["experts"]["layouts"])
        self.blobs = {(b.layer, b.expert): b for b in _blob_entries(header)}
        self._dense_map = dense_map
        self._experts_map = experts_map
        with warnings.catch_warnings():        # the private map is writable; torch need not warn
            warnings.simplefilter("ignore")
            self._dense_u8 = torch.frombuffer(dense_map, dtype=torch.uint8)
            self._experts_u8 = torch.frombuffer(experts_map, dtype=torch.uint8)

    @staticmethod
    def open(path, checksums: bool | None = None) -> "Pack":
        """Map and verify a pack: sizes always; checksums when `checksums` is True, not when False,
        and by default unless its files are the ones a full verification saw (pack/verified.py).
        `verified` says which: checksums verified, skipped, or unchanged since when."""
        path = Path(path)
        header = fmt.read_header(path)
        dense_file, experts_file = path / fmt.DENSE, path / fmt.EXPERTS
        for f in (dense_file, experts_file):
            if not f.exists():
                raise PackError(f"{f}: missing from the pack")
        _check_tokenizer(path)
        since = verified.still_verified(path, header) if checksums is None else None
        check, began = checksums is True or (checksums is None and since is None), time.time()
        dense_map, experts_map = fmt.map_file(dense_file), fmt.map_file(experts_file)
        try:
            fmt.verify_dense(dense_file, dense_map, header["dense"]["tensors"], check)
            fmt.verify_blobs(experts_file, experts_map, _blob_entries(header), check)
        except PackError:
            verified.forget(path)
            raise
        if check:
            verified.remember(path, header, began)
        pack = Pack(path, header, dense_map, experts_map)
        pack.verified = "checksums skipped" if not check and since is None else verified.describe(since)
        return pack

    @property
    def pack_id(self) -> str:
        return self.header["pack_id"]

    @property
    def dense_names(self) -> list[str]:
        return list(self.header["dense"]["tensors"])

    def dense(self, name: str) -> torch.Tensor:
        t = self.header["dense"]["tensors"][name]
        raw = self._dense_u8[t["offset"]:t["offset"] + t["nbytes"]]
        return raw.view(TORCH_DTYPES[t["dtype"]]).view(t["shape"])

    def dense_nbytes(self) -> int:
        return sum(t["nbytes"] for t in self.header["dense"]["tensors"].values())

    def blob(self, layer: int, expert: int) -> torch.Tensor:
        """The raw bytes of one expert blob, uint8 [nbytes], viewing the map."""
        b = self.blobs[(layer, expert)]
        return self._experts_u8[b.offset:b.offset + b.nbytes]

    def warm(self, layer: int, experts: list[int]) -> None:
        """Ask the kernel to read some blobs' pages ahead (MADV_WILLNEED): a pack larger than
        the page cache then reads predicted experts while the current layer computes."""
        for expert in experts:
            b = self.blobs[(layer, expert)]
            start = b.offset - b.offset % mmap.PAGESIZE
            try:
                self._experts_map.madvise(mmap.MADV_WILLNEED, start, b.offset + b.nbytes - start)
            except (AttributeError, OSError, ValueError):
                return                             # no madvise here: reading on demand still works

    def expert_parts(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        b = self.blobs[(layer, expert)]
        return blob_views(self.blob(layer, expert), self.layouts[b.quant])

    def layer_quant(self, layer: int) -> str:
        return self.quant["layers"][str(layer)]

    @property
    def tokenizer_dir(self) -> Path:
        return self.path / fmt.TOKENIZER_DIR

    @property
    def profile_path(self) -> Path:
        return self.path / "profile.json"

    @property
    def mtp_layers(self) -> int:
        """MTP layers packed from the checkpoint (a draft source: --spec mtp)."""
        return (self.header.get("mtp") or {}).get("layers", 0)

    @property
    def model_blobs(self) -> dict:
        """The main model's expert blobs (the cache's candidates); MTP layers' experts stay on the host."""
        return {k: b for k, b in self.blobs.items() if k[0] < self.model.num_layers}

    @property
    def draft(self) -> dict | None:
        return self.header.get("draft")

    def generation_config(self) -> dict:
        f = self.tokenizer_dir / "generation_config.json"
        return json.loads(f.read_text()) if f.exists() else {}


def _blob_entries(header: dict) -> list[fmt.BlobEntry]:
    return [fmt.BlobEntry(*row) for row in header["experts"]["index"]]


def _check_tokenizer(path: Path) -> None:
    tok = path / fmt.TOKENIZER_DIR / "tokenizer.json"
    if not tok.exists():
        raise PackError(f"{tok}: missing from the pack (the tokenizer is required)")

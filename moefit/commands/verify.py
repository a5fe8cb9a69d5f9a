"""moefit verify PACK [--json]: every checksum of a pack, whatever pack/verified.py remembers."""

from __future__ import annotations

import time
from pathlib import Path

from moefit.cli import print_json


def register(sub) -> None:
    p = sub.add_parser("verify", help="check every checksum of a pack (starts skip them while its files are "
                       "the ones last verified)")
    p.add_argument("pack", help="the pack directory")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def run(args) -> int:
    from moefit.pack import verified
    from moefit.pack.reader import Pack
    began = time.perf_counter()
    pack = Pack.open(args.pack, checksums=True)          # a bad file raises PackError: exit 1, named
    seconds = time.perf_counter() - began
    nbytes = pack.dense_nbytes() + sum(b.nbytes for b in pack.blobs.values())
    kept = verified.still_verified(Path(args.pack), pack.header) is not None
    if args.json:
        print_json({"pack_id": pack.pack_id, "ok": True, "bytes": nbytes, "seconds": round(seconds, 3),
                    "tensors": len(pack.dense_names), "blobs": len(pack.blobs), "remembered": kept})
        return 0
    print(f"{args.pack}: {len(pack.dense_names)} tensors and {len(pack.blobs)} expert blobs, {nbytes / 1e9:.2f} GB: "
          f"every checksum verified in {seconds:.1f} s")
    print("later starts skip the checksums while these files are unchanged" if kept else
          "not remembered (a file changed within the last seconds, or the pack directory is read-only): "
          "every start verifies it")
    return 0

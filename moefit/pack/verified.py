"""A pack's checksums, verified once and remembered until its files change.

Verifying a pack reads every byte of it: ~1.4 s a start for the 4.3 GB bench pack with its pages
in memory, and for a 30B pack larger than the page cache a read of all of it from disk (~17 GB,
8 s on NVMe) on every start. After a full verification `PACK/verified.json` records each file's
identity (size, mtime and ctime in ns, inode, device) and the pack id; a later open whose files
are the same ones skips the checksums. Any write to a file moves its ctime (which no tool can
set back), a copy is a new inode, so a changed pack is verified again; `moefit verify PACK`
verifies it whatever the record says.

A file changed less than RACY_S before its verification began is not remembered ("racily
clean", as git calls it): a timestamp's tick is coarse, so a write in the same tick as the
verification could leave the identity unchanged. A pack directory that cannot be written to
is verified on every open, as before.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from moefit.pack import format as fmt

STAMP = "verified.json"
RACY_S = 2.0
FILES = (fmt.HEADER, fmt.DENSE, fmt.EXPERTS)


def identity(path: Path) -> dict[str, list[int]]:
    """Each file's (size, mtime_ns, ctime_ns, inode, device)."""
    out = {}
    for name in FILES:
        st = os.stat(Path(path) / name)
        out[name] = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]
    return out


def still_verified(path: Path, header: dict) -> float | None:
    """When the pack's checksums were verified (epoch seconds), if its files are still the ones
    verified then; else None."""
    try:
        stamp = json.loads((Path(path) / STAMP).read_text())
        same = stamp["pack_id"] == header["pack_id"] and stamp["files"] == identity(path)
        return float(stamp["verified_at"]) if same else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def remember(path: Path, header: dict, began: float) -> bool:
    """Record a verification that began at `began` (time.time()); False where it is not recorded
    (a file changed within RACY_S of it, or the directory is read-only)."""
    try:
        files = identity(path)
        if max(f[2] for f in files.values()) > (began - RACY_S) * 1e9:
            return False
        fmt.write_json_atomic(Path(path) / STAMP, {"pack_id": header["pack_id"], "verified_at": began,
                                                   "files": files})
        return True
    except OSError:
        return False


def forget(path: Path) -> None:
    """Drop the record (a verification failed: the next open verifies again)."""
    try:
        (Path(path) / STAMP).unlink(missing_ok=True)
    except OSError:
        pass


def describe(verified_at: float | None) -> str:
    if verified_at is None:
        return "checksums verified"
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(verified_at))
    return f"unchanged since its checksums were verified ({when}; `moefit verify PACK` checks again)"

"""The start history: one SQLite row per start, updated while it runs; the healthy
slot range of a configuration, calibrated from its clean starts; and the verdict of a
start that falls outside it. No torch.

WAL mode and short transactions: concurrent starts append without corrupting the file.
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from moefit.errors import MoefitError

DB = "history.sqlite"
RANGE_TOLERANCE = 0.10           # widen the calibrated range by 10 % on each side
BUSY_TIMEOUT_S = 5.0             # how long a write waits for another start holding the lock

SCHEMA = """
CREATE TABLE IF NOT EXISTS starts (
  id INTEGER PRIMARY KEY AUTOINCREMENT,
  time REAL NOT NULL, version TEXT, command TEXT, config_hash TEXT, config_json TEXT, pack_id TEXT,
  device_json TEXT, free_bytes_at_start INTEGER, used_bytes_at_start INTEGER,
  zero_check TEXT, zero_check_json TEXT, ledger_json TEXT,
  slots INTEGER, cache_bytes INTEGER, outcome TEXT, message TEXT, verdict TEXT,
  hit_rate REAL, decode_tokens_per_s REAL, guard_warnings INTEGER DEFAULT 0,
  cache_resizes INTEGER DEFAULT 0, slots_now INTEGER, updated REAL, pid INTEGER, ended REAL
)"""
ADDED_COLUMNS = {"pid": "INTEGER", "ended": "REAL"}     # columns newer than the first schema
STARTED_OUTCOMES = ("started", "killed")               # starts that loaded: they calibrate the range
KILLED = ("the process ended without writing its final row (killed with -9, out of host memory, "
          "or the machine stopped)")


class HistoryError(MoefitError):
    pass


@dataclass(frozen=True)
class HealthyRange:
    low: int
    high: int
    clean_starts: int

    def contains(self, slots: int) -> bool:
        return self.low <= slots <= self.high

    def describe(self) -> str:
        return f"{self.low}-{self.high} experts (from {self.clean_starts} clean starts)"


class History:
    """Usage: h = History(state_dir); row = h.append(...); h.update(row, hit_rate=0.8)"""

    def __init__(self, state_dir: Path):
        self.path = Path(state_dir) / DB
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self._connect() as db:
                db.execute("PRAGMA journal_mode=WAL")
                db.execute(SCHEMA)
                have = {r["name"] for r in db.execute("PRAGMA table_info(starts)")}
                for name, kind in ADDED_COLUMNS.items():
                    if name not in have:
                        db.execute(f"ALTER TABLE starts ADD COLUMN {name} {kind}")
        except sqlite3.Error as e:
            raise HistoryError(f"{self.path}: the start history cannot be used ({e})") from None

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
        db.row_factory = sqlite3.Row
        return db

    def _run(self, sql: str, params=(), last_id: bool = False):
        try:
            db = self._connect()
            try:
                cursor = db.execute(sql, params)
                return cursor.lastrowid if last_id else cursor.fetchall()
            finally:
                db.close()
        except sqlite3.Error as e:
            raise HistoryError(f"{self.path}: the start history cannot be used ({e})") from None

    def append(self, **row) -> int:
        row.setdefault("time", time.time())
        row["updated"] = row["time"]
        cols = ", ".join(row)
        marks = ", ".join("?" for _ in row)
        return int(self._run(f"INSERT INTO starts ({cols}) VALUES ({marks})", tuple(row.values()), last_id=True))

    def update(self, row_id: int, **values) -> None:
        values["updated"] = time.time()
        sets = ", ".join(f"{k} = ?" for k in values)
        self._run(f"UPDATE starts SET {sets} WHERE id = ?", (*values.values(), row_id))

    def rows(self, config_hash: str | None = None, last: int | None = None) -> list[dict]:
        self._reap()
        where, params = ("WHERE config_hash = ?", (config_hash,)) if config_hash else ("", ())
        limit = f"LIMIT {int(last)}" if last else ""
        rows = self._run(f"SELECT * FROM starts {where} ORDER BY id DESC {limit}", params)
        return [dict(r) for r in reversed(rows)]

    def healthy_range(self, config_hash: str, exclude_id: int | None = None) -> HealthyRange | None:
        rows = [r for r in self.rows(config_hash) if r["id"] != exclude_id and r["outcome"] in STARTED_OUTCOMES
                and r["zero_check"] == "CLEAN"]
        if not rows:
            return None
        slots = [r["slots"] for r in rows]
        low, high = min(slots), max(slots)
        return HealthyRange(int(low * (1 - RANGE_TOLERANCE)), int(high * (1 + RANGE_TOLERANCE) + 0.999), len(rows))

    def calibrated_configs(self, pack_id: str, exclude_hash: str) -> list[dict]:
        """Configs of this pack with clean starts, other than exclude_hash (newest first)."""
        rows = self._run("SELECT config_hash, config_json FROM starts WHERE pack_id = ? AND config_hash != ? "
                         "AND zero_check = 'CLEAN' AND outcome IN ('started', 'killed') ORDER BY id DESC",
                         (pack_id, exclude_hash))
        return [json.loads(r["config_json"]) for r in rows]


    def _reap(self) -> None:
        """Starts still marked running whose process is gone were killed: say so."""
        live = self._run("SELECT id, pid, time FROM starts WHERE outcome = 'started' AND ended IS NULL "
                         "AND pid IS NOT NULL")
        for r in live:
            if not process_alive(r["pid"], r["time"]):
                self.update(r["id"], outcome="killed", message=KILLED)


def process_alive(pid: int, since: float) -> bool:
    """Is pid the same process that wrote a row at `since` (not a later one reusing the pid)?"""
    import psutil
    try:
        return psutil.Process(pid).create_time() <= since + 1.0
    except psutil.Error:
        return False


def contract_row(r: dict) -> dict:
    return {"id": r["id"], "time": r["time"], "config_hash": r["config_hash"],
            "free_bytes_at_start": r["free_bytes_at_start"], "slots": r["slots"], "cache_bytes": r["cache_bytes"],
            "outcome": r["outcome"], "hit_rate": r["hit_rate"], "decode_tokens_per_s": r["decode_tokens_per_s"],
            "verdict": r["verdict"], "zero_check": r["zero_check"], "message": r["message"],
            "guard_warnings": r["guard_warnings"], "cache_resizes": r["cache_resizes"], "slots_now": r["slots_now"],
            "pack_id": r["pack_id"], "command": r["command"], "pid": r.get("pid"), "ended": r.get("ended")}



def range_verdict(slots: int, zero_check: str, zero_message: str, healthy: HealthyRange | None,
                  config: dict, calibrated: list[dict]) -> str:
    """Why a start landed where it did, in the words an operator needs."""
    if healthy is None:
        if calibrated:
            changed = ", ".join(f"{k}: {calibrated[0].get(k)} -> {v}" for k, v in config.items()
                                if calibrated[0].get(k) != v)
            return f"configuration changed since the calibrated starts: ({changed})"
        if zero_check == "CLEAN":
            return "first clean start of this configuration: it calibrates the healthy range"
        return "no clean start of this configuration yet: the healthy range is not calibrated"
    if healthy.contains(slots):
        return f"inside the healthy range {healthy.describe()}"
    if zero_check == "DIRTY":
        return (f"environment dirty: {zero_message.removeprefix('DIRTY: ')}; configuration unchanged; "
                f"this start ({slots} experts, healthy {healthy.low}-{healthy.high}) does not justify changing it")
    return (f"clean environment and still out of range ({slots} experts, healthy {healthy.low}-{healthy.high}): "
            "investigate the configuration")

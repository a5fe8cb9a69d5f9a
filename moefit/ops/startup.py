"""Every start (generate, serve) goes through here: zero check -> settle -> plan and
load -> history row -> verdict against the healthy range -> banner.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from moefit import __version__
from moefit.config import ServeConfig
from moefit.errors import DirtyCardError, MoefitError, RefusedError
from moefit.memory.devices import open_device
from moefit.ops import measured, zerocheck
from moefit.ops.history import History, HistoryError, range_verdict
from moefit.pack.reader import Pack

PLAN_FIELDS = ("ctx", "kv_dtype", "kv_resident", "sessions", "expert_cache", "vram_reserve_mib", "tier",
               "min_expert_slots", "prefill_chunk", "spec", "spec_window", "compute_dtype", "dense_quant")


@dataclass(frozen=True)
class StartOptions:
    state_dir: Path
    settle_s: float = 20.0
    on_dirty: str = "warn"            # warn | refuse
    tolerance: zerocheck.Tolerance = zerocheck.Tolerance()


def default_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "moefit"


def plan_config(cfg: ServeConfig, pack_id: str, device_name: str, total: int) -> dict:
    """The flags that change the plan, with the pack and the card: what 'same configuration' means."""
    return {**{k: getattr(cfg, k) for k in PLAN_FIELDS}, "pack_id": pack_id, "device": device_name,
            "total_bytes": total}


def config_hash(config: dict) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:12]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass
class Start:
    """One start's record: the zero check, the verdict, and its history row."""

    history: History | None
    row_id: int | None
    zero: zerocheck.ZeroCheck | None
    verdict: str = ""
    config_hash: str = ""
    warnings: list[str] = field(default_factory=list)
    state_dir: Path | None = None                  # where the host's measured choices are kept
    pack: str = ""                                 # how the pack was verified (pack/verified.py)

    def update(self, **values) -> None:
        if self.history is None or self.row_id is None:
            return
        try:
            self.history.update(self.row_id, **values)
        except HistoryError as e:
            log(f"moefit: warning: {e}")
            self.history = None

    def finish(self, engine, final: bool = False, **extra) -> None:
        """Write what the run measured; final=True when the process ends its run cleanly."""
        if self.state_dir is not None:
            measured.keep(self.state_dir, engine.runner.rates)
        book = engine.runner.book
        if final:
            extra["ended"] = time.time()
        self.update(hit_rate=book.hit_rate(), decode_tokens_per_s=engine.decode_rate,
                    slots_now=len(engine.runner.slots), **extra)

    def summary(self) -> dict:
        return {"history_id": self.row_id, "config_hash": self.config_hash, "verdict": self.verdict,
                "zero_check": self.zero.to_json() if self.zero else None, "warnings": self.warnings,
                "pack": self.pack}


def start_engine(pack_path, cfg: ServeConfig, opts: StartOptions | None = None, command: str = "generate",
                 say=log):
    """(Engine, Start) for cfg, after the start-up discipline; raises RefusedError (exit 3)
    or DirtyCardError (exit 4, with --on-dirty refuse)."""
    from moefit.runtime.engine import Engine
    opts = opts or StartOptions(default_state_dir())
    pack = Pack.open(pack_path)
    say(f"pack {pack.pack_id}: {pack.verified}")
    device = open_device(cfg.device)
    if not device.has_vram:
        engine = Engine.open(pack, cfg, say)
        _restore_measured(engine, opts.state_dir, say)
        return engine, Start(None, None, None, "cpu device: no VRAM to check", state_dir=opts.state_dir,
                             pack=pack.verified)
    zero = _zero_check(device, opts, say)
    history = _open_history(opts.state_dir, say)
    snap = zero.snapshot
    config = plan_config(cfg, pack.pack_id, snap.name, snap.total_bytes)
    start = Start(history, None, zero, config_hash=config_hash(config), state_dir=opts.state_dir, pack=pack.verified)
    row = dict(version=__version__, command=command, pid=os.getpid(), config_hash=start.config_hash, config_json=json.dumps(config),
               pack_id=pack.pack_id, device_json=json.dumps(snap.to_json()), free_bytes_at_start=snap.free_bytes,
               used_bytes_at_start=snap.used_bytes, zero_check=zero.verdict,
               zero_check_json=json.dumps(zero.to_json()))
    if zero.verdict == "DIRTY" and opts.on_dirty == "refuse":
        _record(start, row, outcome="refused", message=zero.headline(), verdict="refused: dirty card")
        raise DirtyCardError(f"the card is dirty and --on-dirty refuse was given\n{zero.headline()}")
    try:
        engine = Engine.open(pack, cfg, say)
    except RefusedError as e:
        _record(start, row, ledger_json=json.dumps(e.plan.to_json()["ledger"]) if e.plan else None,
                slots=0, cache_bytes=0, outcome="refused", message=str(e).splitlines()[0],
                verdict=str(e).splitlines()[0])
        raise
    except MoefitError as e:
        _record(start, row, outcome="failed", message=str(e))
        raise
    plan = engine.loaded.plan
    start.verdict = _verdict(start, history, len(engine.runner.slots), zero, config, pack.pack_id)
    _record(start, row, ledger_json=json.dumps(plan.to_json()["ledger"]), slots=len(engine.runner.slots),
            slots_now=len(engine.runner.slots), cache_bytes=engine.runner.book.used, outcome="started",
            verdict=start.verdict)
    _banner(engine, zero, start, say)
    _restore_measured(engine, opts.state_dir, say)
    return engine, start


def _restore_measured(engine, state_dir: Path, say) -> None:
    if taken := measured.restore(state_dir, engine.runner.rates):
        say(f"host: {taken} measured choices (prompt products' ways, expert GEMM crossovers) kept from an "
            f"earlier start on this machine ({Path(state_dir) / measured.FILE})")


def _zero_check(device, opts: StartOptions, say) -> zerocheck.ZeroCheck:
    read = device.snapshot
    zero = zerocheck.check(read(), zerocheck.load_baseline(opts.state_dir, read()), opts.tolerance)
    if zero.verdict == "DIRTY" and opts.settle_s > 0:
        say(f"zero check: {zero.headline()}; waiting up to {opts.settle_s:.0f} s for memory to settle")
        settled = zerocheck.wait_release(read, opts.settle_s, interval_s=min(1.0, opts.settle_s / 3))
        say(f"zero check: {settled.describe()}")
        zero = zerocheck.check(settled.last, zero.baseline, opts.tolerance)
    return zero


def _open_history(state_dir: Path, say) -> History | None:
    try:
        return History(state_dir)
    except HistoryError as e:
        say(f"moefit: warning: {e}; this start is not recorded")
        return None


def _record(start: Start, row: dict, **values) -> None:
    if start.history is None:
        return
    try:
        start.row_id = start.history.append(**row, **values)
    except HistoryError as e:
        log(f"moefit: warning: {e}; this start is not recorded")
        start.history = None


def _verdict(start: Start, history: History | None, slots: int, zero, config: dict, pack_id: str) -> str:
    if history is None:
        return "no start history: the healthy range is unknown"
    try:
        healthy = history.healthy_range(start.config_hash)
        calibrated = history.calibrated_configs(pack_id, start.config_hash)
    except HistoryError as e:
        return f"start history unreadable ({e})"
    verdict = range_verdict(slots, zero.verdict, zero.headline(), healthy, config, calibrated)
    return verdict + (zero.leftover_note() if zero.verdict == "NO BASELINE" else "")


def _banner(engine, zero, start: Start, say) -> None:
    plan = engine.loaded.plan
    say(plan.table())
    say(f"serve check: {plan.serve_status} ({plan.serve_message})")
    say(f"speculative: {'on' if plan.spec_enabled else 'off'} ({plan.spec_reason})")
    say(f"zero check: {zero.headline()}")
    if zero.verdict == "DIRTY":
        bar = "!" * 78
        say(f"{bar}\n!! DIRTY CARD: this start got {len(engine.runner.slots)} experts; other programs hold memory."
            f"\n!! {zero.headline()}\n!! Do not change the configuration because of this start.\n{bar}")
    say(f"verdict: {start.verdict}")
    for note in engine.loaded.notes:
        say(f"note: {note}")

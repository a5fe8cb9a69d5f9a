"""The start-up discipline, replayed on a simulated card: the seed's four starts."""

import json
import sqlite3
import subprocess
import sys
import threading
import time

import pytest

from moefit.config import ServeConfig
from moefit.errors import DirtyCardError, RefusedError
from moefit.memory.devices import open_device
from moefit.ops import history as history_mod
from moefit.ops import zerocheck
from moefit.ops.history import History
from moefit.ops.startup import StartOptions, start_engine

DESKTOP = [(2101, "gnome-shell", 3.0), (2300, "hermes", 1.0)]
CARD_MIB = 5.6
TOL = zerocheck.Tolerance(total_mib=0.04, process_mib=0.02)       # scaled like the card


def cfg(card_path, **flags):
    return ServeConfig(**{"device": f"sim:{card_path}", "ctx": 64, "vram_reserve_mib": 1, "low_headroom_mib": 0,
                          **flags})


@pytest.fixture
def seed(packs, card, tmp_path):
    """(pack, card path, options) with a clean baseline saved for a card where the
    auto cache holds about half of the experts."""
    pack = packs("mixtral", "int8")
    path = card(CARD_MIB, DESKTOP)
    opts = StartOptions(tmp_path / "state", settle_s=0, tolerance=TOL)
    zerocheck.save_baseline(opts.state_dir, open_device(f"sim:{path}").snapshot())
    return pack, path, opts


def test_four_starts_four_verdicts(seed, card):
    pack, path, opts = seed
    quiet = lambda msg: None  # noqa: E731
    e1, s1 = start_engine(pack, cfg(path), opts, say=quiet)
    clean_slots = len(e1.runner.slots)
    assert s1.zero.verdict == "CLEAN" and "calibrates the healthy range" in s1.verdict
    assert 6 <= clean_slots < 24

    card(CARD_MIB, DESKTOP + [(4100, "moefit", 0.07), (4200, "chromium", 0.05)])      # old instance + browser
    banner = []
    e2, s2 = start_engine(pack, cfg(path), opts, say=banner.append)
    assert len(e2.runner.slots) < clean_slots * 0.9
    assert s2.zero.verdict == "DIRTY"
    assert {c.name for c in s2.zero.culprits} == {"moefit", "chromium"}
    assert s2.verdict.startswith("environment dirty") and "does not justify changing it" in s2.verdict
    assert any("DIRTY CARD" in line for line in banner)

    card(CARD_MIB, DESKTOP + [(4100, "moefit", 1.6)])
    with pytest.raises(RefusedError):
        start_engine(pack, cfg(path), opts, say=quiet)

    card(CARD_MIB, DESKTOP)
    e4, s4 = start_engine(pack, cfg(path), opts, say=quiet)
    assert len(e4.runner.slots) == clean_slots and s4.verdict.startswith("inside the healthy range")

    rows = History(opts.state_dir).rows()
    assert [r["outcome"] for r in rows] == ["started", "started", "refused", "started"]
    assert [r["zero_check"] for r in rows] == ["CLEAN", "DIRTY", "DIRTY", "CLEAN"]
    assert rows[2]["slots"] == 0 and "refused" in rows[2]["message"]
    assert len({r["config_hash"] for r in rows}) == 1
    healthy = History(opts.state_dir).healthy_range(rows[0]["config_hash"])
    assert healthy.clean_starts == 2 and healthy.contains(clean_slots)          # dirty starts never move it


def test_a_changed_configuration_is_named(seed):
    pack, path, opts = seed
    start_engine(pack, cfg(path), opts, say=lambda m: None)
    _, s = start_engine(pack, cfg(path, ctx=48), opts, say=lambda m: None)
    assert s.verdict == "configuration changed since the calibrated starts: (ctx: 64 -> 48)"


def test_on_dirty_refuse_exits_4_and_is_recorded(seed, card):
    pack, path, opts = seed
    card(CARD_MIB, DESKTOP + [(4200, "chromium", 0.5)])
    with pytest.raises(DirtyCardError) as e:
        start_engine(pack, cfg(path), StartOptions(opts.state_dir, settle_s=0, on_dirty="refuse", tolerance=TOL))
    assert e.value.exit_code == 4 and "chromium" in str(e.value)
    assert History(opts.state_dir).rows()[-1]["outcome"] == "refused"


def test_the_wait_sees_memory_released_late(card):
    path = card(20, DESKTOP + [(4100, "moefit", 2.0)])
    device = open_device(f"sim:{path}")

    def old_instance_exits():
        time.sleep(0.1)
        card(20, DESKTOP, unattributed_mib=1.0)             # the process is gone, the driver still holds some
        time.sleep(0.4)
        card(20, DESKTOP)
    threading.Thread(target=old_instance_exits).start()
    settled = zerocheck.wait_release(device.snapshot, timeout_s=5, interval_s=0.2, band_mib=0)
    assert settled.stable and settled.waited_s >= 0.8
    assert settled.last.free_bytes - settled.first.free_bytes == 2 << 20
    assert "+2 MiB free while waiting" in settled.describe()


def test_memory_held_by_no_live_process_is_a_culprit(card, tmp_path):
    device = open_device(f"sim:{card(CARD_MIB * 100, DESKTOP)}")
    base = device.snapshot()
    card(CARD_MIB * 100, DESKTOP, unattributed_mib=300)
    result = zerocheck.check(device.snapshot(), base)
    assert result.verdict == "DIRTY" and result.culprits[0].why == "no live process"


def test_a_corrupt_history_does_not_stop_the_start(seed, capsys):
    pack, path, opts = seed
    (opts.state_dir / "history.sqlite").write_bytes(b"this is not a database" * 100)
    said = []
    engine, start = start_engine(pack, cfg(path), opts, say=said.append)
    assert len(engine.runner.slots) > 0 and start.row_id is None
    assert any("start history cannot be used" in s for s in said)


def test_a_locked_history_does_not_stop_the_start(seed, monkeypatch):
    pack, path, opts = seed
    History(opts.state_dir)
    monkeypatch.setattr(history_mod, "BUSY_TIMEOUT_S", 0.2)
    lock = sqlite3.connect(opts.state_dir / "history.sqlite", isolation_level=None)
    lock.execute("BEGIN EXCLUSIVE")
    try:
        engine, start = start_engine(pack, cfg(path), opts, say=lambda m: None)
        assert len(engine.runner.slots) > 0 and start.row_id is None
    finally:
        lock.execute("ROLLBACK")


def test_doctor_and_history_commands(seed, card):
    pack, path, opts = seed
    run = lambda *a: subprocess.run([sys.executable, "-m", "moefit", *a, "--state-dir", str(opts.state_dir),  # noqa: E731
                                     "--tolerance-mib", "0.04", "--process-tolerance-mib", "0.02"],
                                    capture_output=True, text=True)
    r = run("doctor", "--device", f"sim:{path}", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["verdict"] == "CLEAN"
    card(CARD_MIB, DESKTOP + [(4100, "moefit", 0.0625)])
    r = run("doctor", "--device", f"sim:{path}")
    assert r.returncode == 4 and "DIRTY" in r.stdout and "previous moefit instance" in r.stdout
    out = json.loads(run("doctor", "--device", f"sim:{path}", "--json").stdout)
    assert out["culprits"][0]["name"] == "moefit" and out["culprits"][0]["bytes_over"] == 64 * 1024
    r = run("generate", str(pack), "--prompt", "the", "--max-tokens", "3", "--device", f"sim:{path}",
            "--vram-reserve-mib", "1", "--ctx", "64", "--settle-s", "0")
    assert r.returncode == 0 and "DIRTY CARD" in r.stderr
    hist = json.loads(run("history", "--json").stdout)["starts"]
    assert hist[-1]["outcome"] == "started" and hist[-1]["hit_rate"] is not None
    assert "start" in run("history").stdout
    r = subprocess.run([sys.executable, "-m", "moefit", "doctor"], capture_output=True, text=True)
    assert r.returncode == 1 and "NVML is not available" in r.stderr and "Traceback" not in r.stderr


def test_two_processes_of_one_name_each_keep_their_own_baseline(card, tmp_path):
    from moefit.commands.doctor import render
    base = open_device(f"sim:{card(4000, [(10, 'chromium', 400), (11, 'chromium', 100)])}").snapshot()
    zerocheck.save_baseline(tmp_path, base)
    now = open_device(f"sim:{card(4000, [(10, 'chromium', 400), (12, 'chromium', 1500)])}").snapshot()
    result = zerocheck.check(now, zerocheck.load_baseline(tmp_path, now))
    assert [(c.pid, c.why, c.bytes_over) for c in result.culprits] == [(12, "grew", 1400 * 2**20)]
    rows = {line.split()[0]: line.split()[-1] for line in render(result).splitlines()[1:3]}
    assert rows == {"12": "100", "10": "400"}             # each its own baseline, not the 500 MiB sum


def test_with_no_baseline_a_leftover_moefit_is_named_in_the_verdict_and_the_history(packs, card, tmp_path):
    path = card(CARD_MIB, DESKTOP + [(4100, "moefit", 0.0625)])
    opts = StartOptions(tmp_path / "state", settle_s=0, tolerance=TOL)
    engine, start = start_engine(packs("mixtral", "int8"), cfg(path), opts)
    assert start.zero.verdict == "NO BASELINE"
    assert "another moefit holds the card (pid 4100 moefit" in start.verdict
    row = History(opts.state_dir).rows()[-1]
    assert "likely a leftover instance" in row["verdict"] and "pid 4100" in row["zero_check_json"]

"""bench/isolated.py, the device check's runner: a check that hangs or kills its process costs
only itself, the rest still run in a fresh child, and what a long check had is kept."""

import sys
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.isolated import run_isolated  # noqa: E402

CHILD = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {root!r})
    from bench.isolated import Journal
    journal = Journal(sys.argv[1])
    for name in sys.argv[2].split(","):
        journal.start(name)
        if name.startswith("hang"):
            journal.partial({{"rows": 1}})
            time.sleep(60)
        if name.startswith("die"):
            os._exit(7)
        journal.done(name, {{"ok": True, "pid": os.getpid()}})
""")


def _runner(tmp_path: Path):
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(root=str(Path(__file__).resolve().parent.parent)))
    return lambda todo, journal: [sys.executable, str(script), str(journal), ",".join(todo)]


def test_a_hang_and_a_death_cost_only_themselves(tmp_path):
    seen = []
    t = time.time()
    results = run_isolated(_runner(tmp_path), ["a", "hang", "b", "die", "c"], {"hang": 1.0}, budget_s=30,
                           on_result=lambda name, result: seen.append(name))
    assert time.time() - t < 20
    assert seen == ["a", "hang", "b", "die", "c"]
    assert [results[n]["ok"] for n in seen] == [True, False, True, False, True]
    assert "over its limit" in results["hang"]["error"] and results["hang"]["partial"] == {"rows": 1}
    assert "exit code 7" in results["die"]["error"]
    assert len({results[n]["pid"] for n in ("a", "b", "c")}) == 3          # a fresh child after each loss


def test_the_budget_skips_what_it_does_not_reach(tmp_path):
    results = run_isolated(_runner(tmp_path), ["a", "hang", "b"], {"hang": 60}, budget_s=2)
    assert results["a"]["ok"] is True
    assert results["hang"]["ok"] is False
    assert results["b"]["ok"] is None and "budget" in results["b"]["skipped"]


def test_a_child_that_cannot_start_fails_every_check_once(tmp_path):
    t = time.time()
    results = run_isolated(lambda todo, journal: [sys.executable, "-c", "raise SystemExit(3)"], ["a", "b"], {},
                           budget_s=30)
    assert time.time() - t < 10
    assert all(r["ok"] is False and "(3)" in r["error"] for r in results.values())

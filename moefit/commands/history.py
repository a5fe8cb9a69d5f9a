"""moefit history [--config HASH] [--last N] [--json]: the start history, the seed's table."""

from __future__ import annotations

import time

from moefit.cli import add_state_flags, print_json, state_dir

MIB = 1 << 20


def register(sub) -> None:
    p = sub.add_parser("history", help="the start history: slots, outcome and verdict of every start")
    p.add_argument("--config", metavar="HASH", help="only the starts of this configuration")
    p.add_argument("--last", type=int, metavar="N", help="only the last N starts")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_state_flags(p, start=False)
    p.set_defaults(run=run)


def run(args) -> int:
    from moefit.ops.history import History, contract_row
    rows = History(state_dir(args)).rows(args.config, args.last)
    if args.json:
        print_json({"starts": [contract_row(r) for r in rows]})
    else:
        print(render(rows) if rows else "no starts recorded yet")
    return 0


def render(rows: list[dict]) -> str:
    head = ("start", "time", "config", "VRAM when it started", "expert cache", "outcome", "hit rate", "tok/s",
            "verdict")
    table = [head] + [_cells(r) for r in rows]
    widths = [max(len(row[i]) for row in table[:]) for i in range(len(head) - 1)]
    lines = []
    for row in table:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1])
    return "\n".join(lines)


def _cells(r: dict) -> tuple[str, ...]:
    state = f"{r['zero_check'] or '?'}: {(r['free_bytes_at_start'] or 0) / MIB:,.0f} MiB free"
    size = r["cache_bytes"] or 0
    size_text = f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / MIB:.2f} MiB"
    cache = "-" if r["slots"] is None else f"{r['slots']} / {size_text}"
    if r["slots_now"] is not None and r["slots"] is not None and r["slots_now"] != r["slots"]:
        cache += f" (now {r['slots_now']})"
    hit = "-" if r["hit_rate"] is None else f"{100 * r['hit_rate']:.0f}%"
    tps = "-" if not r["decode_tokens_per_s"] else f"{r['decode_tokens_per_s']:.1f}"
    outcome = r["outcome"] or "?"
    return (str(r["id"]), time.strftime("%m-%d %H:%M", time.localtime(r["time"])), r["config_hash"] or "-",
            state, cache, outcome, hit, tps, r["verdict"] or r["message"] or "")

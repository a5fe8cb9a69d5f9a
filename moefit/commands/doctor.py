"""moefit doctor [--device ...] [--save-baseline] [--wait-release S] [--json]: the zero check."""

from __future__ import annotations

from moefit.cli import add_state_flags, print_json, state_dir
from moefit.errors import UsageError
from moefit.memory.devices import MIB


def register(sub) -> None:
    p = sub.add_parser("doctor", help="check the card against its clean baseline (the zero check)")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or sim:CARD.json (default: cuda)")
    p.add_argument("--save-baseline", action="store_true", help="record the card now as its clean baseline")
    p.add_argument("--wait-release", type=float, metavar="S",
                   help="first wait up to S seconds for free memory to be stable (three reads within 64 MiB)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_state_flags(p, start=False)
    p.set_defaults(run=run)


def run(args) -> int:
    from moefit.memory.devices import open_device
    from moefit.memory.planner import device_json
    from moefit.ops import zerocheck
    from moefit.runtime.placement import device_snapshot
    device = open_device(args.device)
    if not device.has_vram:
        raise UsageError("the zero check needs a card: --device cuda or --device sim:CARD.json")
    read = lambda: device_snapshot(device)  # noqa: E731
    waited = zerocheck.wait_release(read, args.wait_release) if args.wait_release else None
    snap = waited.last if waited else read()
    directory = state_dir(args)
    if args.save_baseline:
        saved = zerocheck.save_baseline(directory, snap)
        if not args.json:
            print(f"saved the clean baseline of {snap.name}: {snap.used_bytes / MIB:,.0f} MiB used ({saved})")
    tol = zerocheck.Tolerance(args.tolerance_mib, args.process_tolerance_mib)
    result = zerocheck.check(snap, zerocheck.load_baseline(directory, snap), tol)
    if args.json:
        out = {"device": device_json(result.snapshot), **result.to_json()}
        if waited:
            out["wait_release"] = {"stable": waited.stable, "waited_s": waited.waited_s, "message": waited.describe()}
        print_json(out)
    else:
        if waited:
            print(waited.describe())
        print(render(result))
    return 4 if result.verdict == "DIRTY" else 0


def render(result) -> str:
    from moefit.ops import zerocheck
    snap, base = result.snapshot, result.baseline
    before = zerocheck.matched_baseline(snap.processes, base.processes) if base else {}
    rows = [f"{'pid':>8}  {'process':<28} {'MiB':>8}  {'baseline':>8}"]
    for p in sorted(snap.processes, key=lambda p: -p.bytes):
        b = "-" if not base else "new" if before[p.pid] is None else f"{before[p.pid] / MIB:,.0f}"
        rows.append(f"{p.pid:>8}  {p.name[:28]:<28} {p.bytes / MIB:>8,.0f}  {b:>8}")
    if snap.unattributed_bytes:
        rows.append(f"{'-':>8}  {'(no live process)':<28} {snap.unattributed_bytes / MIB:>8,.0f}")
    rows.append("")
    rows.append(f"{snap.name}: {snap.total_bytes / MIB:,.0f} MiB, used {snap.used_bytes / MIB:,.0f}, "
                f"free {snap.free_bytes / MIB:,.0f}" + (f" (baseline: used {base.used_bytes / MIB:,.0f}, "
                                                       f"free {base.free_bytes / MIB:,.0f})" if base else ""))
    rows.append(f"verdict: {result.headline()}")
    if any(c.why == "previous moefit" for c in result.culprits) and base:
        rows.append("a previous moefit instance still holds memory: stop it, then "
                    "`moefit doctor --wait-release 30` before starting again")
    return "\n".join(rows)

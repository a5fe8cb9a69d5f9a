"""The moefit command line. Errors become exit codes here and nowhere else:
0 success, 1 error, 2 usage, 3 does not fit (refused), 4 dirty card (doctor).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from moefit import __version__
from moefit.config import ServeConfig, serve_config_fields
from moefit.errors import MoefitError, UsageError


def add_serve_flags(p: argparse.ArgumentParser) -> None:
    """One flag per ServeConfig field; the field's help is the flag's help."""
    for f in serve_config_fields():
        flag = "--" + f.name.replace("_", "-")
        kind = {"int": int, "float": float, "int | None": int, "float | None": float}.get(str(f.type), str)
        p.add_argument(flag, dest=f.name, type=kind, default=f.default, choices=f.metadata.get("choices"),
                       help=f.metadata["help"] + (f" (default: {f.default})" if f.default is not None else ""))


def serve_config(args: argparse.Namespace) -> ServeConfig:
    cfg = ServeConfig(**{f.name: getattr(args, f.name) for f in serve_config_fields()})
    if cfg.expert_cache != "auto" and not cfg.expert_cache.isdigit():
        raise UsageError(f"--expert-cache must be auto or a whole number, not {cfg.expert_cache!r}")
    if cfg.kv_resident not in ("auto", "all") and not cfg.kv_resident.isdigit():
        raise UsageError(f"--kv-resident must be auto, all or a number of tokens, not {cfg.kv_resident!r}")
    return cfg


def add_state_flags(p: argparse.ArgumentParser, start: bool = True) -> None:
    p.add_argument("--state-dir", help="where the baseline and the start history live "
                   "(default: $XDG_STATE_HOME/moefit)")
    if start:
        p.add_argument("--settle-s", type=float, default=20.0,
                       help="when the card is dirty, wait this long for memory to settle (default: 20)")
        p.add_argument("--on-dirty", choices=("warn", "refuse"), default="warn",
                       help="a dirty card: start with a loud banner, or refuse (exit 4)")
    p.add_argument("--tolerance-mib", type=float, default=256,
                   help="zero check: allowed use above the baseline, in all (default: 256)")
    p.add_argument("--process-tolerance-mib", type=float, default=64,
                   help="zero check: allowed for a new or grown process (default: 64)")


def state_dir(args: argparse.Namespace):
    from moefit.ops.startup import default_state_dir
    return Path(args.state_dir) if args.state_dir else default_state_dir()


def start_options(args: argparse.Namespace):
    from moefit.ops.startup import StartOptions
    from moefit.ops.zerocheck import Tolerance
    return StartOptions(state_dir(args), args.settle_s, args.on_dirty,
                        Tolerance(args.tolerance_mib, args.process_tolerance_mib))


def build_parser() -> argparse.ArgumentParser:
    from moefit.commands import register_all
    parser = argparse.ArgumentParser(prog="moefit", description="Serve MoE models larger than the GPU, "
                                     "with every byte of VRAM explained.")
    parser.add_argument("--version", action="version", version=f"moefit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    register_all(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except MoefitError as e:
        print(f"moefit: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("moefit: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:                      # `moefit ... | head`: the reader left, not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def print_json(obj) -> None:
    print(json.dumps(obj, indent=1, default=_json_default))


def _json_default(o):
    if dataclasses.is_dataclass(o):
        return dataclasses.asdict(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")

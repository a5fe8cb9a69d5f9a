"""`make run`: pack the demo model (cached) and serve it, on the GPU when there is one,
otherwise on the simulated card shipped beside it.

    python -m moefit.demo [--port 8080] [more `moefit serve` flags]
"""

from __future__ import annotations

import sys

from moefit.demo import CARD, SIM_FLAGS, demo_pack


def device() -> str:
    try:
        import torch
        if torch.cuda.is_available():
            return "cuda"
    except ImportError:
        pass
    return f"sim:{CARD}"


def save_demo_baseline(dev: str, state_dir) -> None:
    """The shipped card is clean by construction: record it as its baseline once."""
    from moefit.memory.devices import open_device
    from moefit.ops import zerocheck
    snap = open_device(dev).snapshot()
    if zerocheck.load_baseline(state_dir, snap) is None:
        zerocheck.save_baseline(state_dir, snap)
        print(f"saved the simulated card's clean baseline in {state_dir}", file=sys.stderr)


def main(argv: list[str]) -> int:
    from moefit.cli import main as cli
    from moefit.ops.startup import default_state_dir
    pack = demo_pack(lambda m: print(m, file=sys.stderr))
    dev = device()
    flags = [] if dev == "cuda" else SIM_FLAGS
    if dev != "cuda":
        save_demo_baseline(dev, default_state_dir())
    print(f"moefit demo: serving {pack.name} on {dev}", file=sys.stderr)
    return cli(["serve", str(pack), "--device", dev, "--served-model-name", "moefit-demo", *flags, *argv])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

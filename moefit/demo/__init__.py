"""The bundled demo: a small Qwen3-MoE trained on WordNet glosses (model/), packed on first
use, served on the GPU when there is one, otherwise on a simulated 12 GB-class card scaled
to the demo model so that about a quarter of its experts fit (card.json)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

HERE = Path(__file__).parent
MODEL = HERE / "model"
CARD = HERE / "card.json"
PROFILE = HERE / "profile.json"         # expert hotness from the training corpus (tools/profile_demo.py)
PROBE = HERE / "probe.bin"              # the look-ahead's probe, fitted on the same documents
PROBE_SECTION = HERE / "probe.json"     # ... and its pack header section (layers, recalls)
QUANT = "int8"
# The seed's desktop baseline (2,367 MiB of a 12,282 MiB RTX 4070), as shares of the card.
SEED_DESKTOP = [(2101, "gnome-shell", 587), (2300, "hermes", 573), (2410, "chromium", 434),
                (2411, "chromium", 4), (2520, "nautilus", 139), (2630, "ptyxis", 71), (2740, "resources", 73),
                (2850, "others", 486)]
SEED_TOTAL_MIB = 12282
# Flags the simulated card needs: the defaults are sized for real cards (a 512 MiB floor,
# a 256 MiB headroom), this card is a few tens of MiB. A 64K context (what agent clients ask
# for) with the most recent 2,048 tokens' KV on the card and the rest in host memory (KV
# streaming). The demo model was trained on short texts: 64K is what the card and the engine
# serve, not what this model reads well.
SIM_FLAGS = ["--ctx", "65536", "--kv-resident", "2048", "--prefill-chunk", "128", "--vram-reserve-mib", "4",
             "--low-headroom-mib", "1", "--min-free-vram-mib", "1", "--grow-margin-mib", "1", "--tolerance-mib", "0.5",
             "--process-tolerance-mib", "0.25", "--spec", "lookup"]


def sim_flag(name: str) -> float:
    """The value SIM_FLAGS gives a flag (`sim_flag("--vram-reserve-mib")` -> 4.0)."""
    return float(SIM_FLAGS[SIM_FLAGS.index(name) + 1])


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "moefit"


def model_digest() -> str:
    h = hashlib.sha256()
    for f in sorted(MODEL.iterdir()):
        if f.suffix in (".json", ".safetensors", ".jinja"):
            h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()[:12]


def demo_pack(log=print) -> Path:
    """The demo model's pack, written on first use and reused after, with the shipped
    expert profile and look-ahead probe (the demo never serves blind)."""
    from moefit.experts import probe
    from moefit.pack.convert import convert
    from moefit.pack.reader import Pack
    pack = cache_dir() / f"demo-{model_digest()}-{QUANT}.pack"
    if not (pack / "moefit-pack.json").exists():
        log(f"packing the demo model into {pack} ...")
        convert(MODEL, pack, QUANT, progress=False)
    opened = Pack.open(pack, checksums=False)
    if PROFILE.exists() and not opened.profile_path.exists():
        opened.profile_path.write_bytes(PROFILE.read_bytes())
    if PROBE.exists() and "probe" not in opened.header:
        probe.install(pack, PROBE, json.loads(PROBE_SECTION.read_text()))
    return pack

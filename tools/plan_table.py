"""The README's plan table: every config in configs/ at 32K, 131K and 262K tokens of context,
int4 experts, int8 KV, bf16 compute, on the simulated RTX 4070 (docs/rtx4070.json, the seed's
desktop baseline of 2,367 MiB), KV streaming on auto.

    .venv/bin/python tools/plan_table.py
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from moefit.config import ModelConfig, ServeConfig  # noqa: E402
from moefit.experts.profile import Profile  # noqa: E402
from moefit.memory.devices import open_device  # noqa: E402
from moefit.memory.footprint import from_config  # noqa: E402
from moefit.memory.planner import plan  # noqa: E402

CTXS = (32768, 131072, 262144)


def cell(model, ctx: int, snap) -> str:
    """Experts cached (share), and the KV streaming window when one is needed; with the dense
    weights in bf16, or else with --dense-quant int4 (marked dq4)."""
    for dense_quant in ("off", "int4"):
        fp = from_config(model, "int4", "bf16", dense_quant=dense_quant)
        cfg = ServeConfig(device="sim:card", ctx=ctx, kv_dtype="int8", compute_dtype="bf16", dense_quant=dense_quant)
        p = plan(fp, cfg, snap, Profile.empty(model.num_layers, model.num_experts).hottest_first(list(fp.blob_sizes)))
        if not p.refused:
            break
    if p.refused:
        return "refused"
    mark = "dq4: " if dense_quant != "off" else ""
    stream = f", {p.kv_resident // 1024}K resident + {p.host_state_bytes / 2**30:.1f} GiB host" if p.kv_resident else ""
    return f"{mark}{p.slots} ({100 * p.slots / p.total_experts:.0f} %){stream}"


def main() -> None:
    snap = open_device(f"sim:{ROOT / 'docs' / 'rtx4070.json'}").snapshot()
    print("| model (family) | " + " | ".join(f"{c // 1024}K" for c in CTXS) + " |")
    print("|---|" + "---|" * len(CTXS))
    for path in sorted((ROOT / "configs").glob("*.json")):
        model = ModelConfig.from_hf_file(path)
        cells = [cell(model, ctx, snap) for ctx in CTXS]
        print(f"| {path.stem} ({model.family}) | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

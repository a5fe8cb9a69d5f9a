"""moefit plan (PACK | --model-config config.json --quant Q) [serve flags] [--json]

Answers "does it fit?" for a pack, or for a model that is not downloaded yet.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from moefit.cli import add_serve_flags, print_json, serve_config
from moefit.experts.profile import no_profile_note
from moefit.errors import UsageError
from moefit.pack.layout import RECIPES


def register(sub) -> None:
    p = sub.add_parser("plan", help="print the VRAM ledger of a start without starting")
    p.add_argument("pack", nargs="?", help="the pack directory")
    p.add_argument("--model-config", metavar="CONFIG_JSON", help="plan from an HF config.json, no weights needed")
    p.add_argument("--quant", default="int4", choices=RECIPES, help="expert quantization (with --model-config)")
    p.add_argument("--group-size", type=int, default=32, help="int4 group size (with --model-config)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_serve_flags(p)
    p.set_defaults(run=run)


def footprint_and_order(args, compute_dtype: str, dense_quant: str = "off"):
    from moefit.config import ModelConfig
    from moefit.experts.profile import Profile
    from moefit.memory import footprint
    if args.model_config:
        model = ModelConfig.from_hf_file(args.model_config)
        fp = footprint.from_config(model, args.quant, compute_dtype, args.group_size, dense_quant)
        profile = Profile.empty(model.num_layers, model.num_experts)
    else:
        from moefit.pack.format import read_header
        header = read_header(Path(args.pack))
        fp = footprint.from_pack_header(header, compute_dtype, dense_quant)
        profile = Profile.load(Path(args.pack) / "profile.json", fp.model.num_layers, fp.model.num_experts)
    return fp, profile.hottest_first(list(fp.blob_sizes)), not profile.is_empty


def run(args) -> int:
    from moefit.memory.devices import host_available_bytes, open_device
    from moefit.memory.planner import plan
    from moefit.runtime.loader import compute_dtype_for
    from moefit.runtime.placement import device_snapshot
    if bool(args.pack) == bool(args.model_config):
        raise UsageError("give a pack, or --model-config CONFIG_JSON (not both)")
    cfg = serve_config(args)
    device = open_device(cfg.device)
    if not device.has_vram:
        raise UsageError("planning needs a card: --device cuda or --device sim:CARD.json")
    fp, order, profiled = footprint_and_order(args, compute_dtype_for(cfg, device.kind), cfg.dense_quant)
    p = plan(fp, cfg, device_snapshot(device), order, host_available_bytes())
    if args.pack and not profiled:
        p = dataclasses.replace(p, serve_message=f"{p.serve_message}; {no_profile_note(p.slots, p.total_experts)}")
    if args.json:
        print_json(p.to_json())
    else:
        print(render_plan(p))
    return 3 if p.refused else 0


def render_plan(p) -> str:
    lines = [p.table(), "",
             f"expert cache: {p.slots} of {p.total_experts} experts, {p.cache_used / 2**20:,.0f} MiB "
             f"(largest blob {p.largest_blob / 1024:,.0f} KiB, minimum {p.min_slots} experts)",
             f"serve check: {p.serve_status} ({p.serve_message})",
             f"speculative: {'on' if p.spec_enabled else 'off'} ({p.spec_reason})"]
    if p.fixes:
        lines += ["fixes:"] + [f"  - {f}" for f in p.fixes]
    return "\n".join(lines)

"""The device check's decode measurement (bench/gpu_check.py): tok/s of a Qwen3-30B-A3B-shaped
int4 pack, its first 12 of 48 layers, under an emulated 12 GiB card with 25 / 50 / 100 % of its
experts cached. A 48-layer figure is extrapolated as 12 / 48 of the per-token time (experts and
attention scale with layers; the lm_head, ~4 % of a token, is counted 4 times: a lower bound).
Each share is measured after 64 warm tokens (every host expert's first use, when its panel copy
is made, falls in those); the ledger is compared with NVML at each. Each share also without the
slot-table kernels (the grouped path) and with --decode-graphs on, at 100 % also without any
fused kernel (the torch path), at 25 % also without look-ahead.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from bench.gpu_check import MIB, ROOT, _against_nvml, cfg
from moefit.runtime.engine import Engine
from moefit.runtime.sampler import SamplingParams


def check_decode(device: str, quick: bool, journal=None, pack_dir: str | None = None, quant: str = "int4") -> dict:
    """tok/s of a Qwen3-30B-A3B-shaped pack's first 12 layers under a 12 GiB cap (int4 experts, or
    a GGUF file's kept super-blocks: quant q4_k/q6_k); each share's row is journalled as it lands,
    so a run stopped by the budget keeps the rows it has."""
    if quick or not device.startswith("cuda"):
        return {"ok": None, "skipped": "needs CUDA and a few minutes (not --quick)"}
    from bench.synthetic_pack import build_pack
    from moefit.pack.reader import Pack
    t = time.time()
    name = "q30-12.pack" if quant == "int4" else f"q30-12-{quant.replace('/', '-')}.pack"
    pack = Path(pack_dir or tempfile.mkdtemp()) / name
    if not (pack / "moefit-pack.json").exists():     # --pack-dir keeps it for bench/gpu_profile.py --pack
        build_pack(ROOT / "configs" / "qwen3-30b-a3b.json", pack, quant, layers=12, distinct=16)
    out = {"ok": None, "quant": quant, "pack_seconds": round(time.time() - t, 1), "rows": {}}
    total = len(Pack.open(pack, checksums=False).blobs)
    cap = 12 * 1024 * MIB
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / torch.cuda.get_device_properties(0).total_memory))
    for share in (0.25, 0.5, 1.0):
        e = Engine.open(pack, cfg(device, expert_cache=str(int(share * total))))
        e.generate(list(range(100, 164)), SamplingParams(max_tokens=64, temperature=1.0, seed=1, ignore_eos=True))
        first = e.last.decode_tokens_per_s              # every host expert's first use is in here
        prompt = list(range(200, 264))                  # another prompt: its prefill is measured too
        e.generate(prompt, SamplingParams(max_tokens=64, temperature=1.0, seed=2, ignore_eos=True))
        dt = 1 / e.last.decode_tokens_per_s
        row = out["rows"][f"{int(share * 100)}%"] = {
            "slots": len(e.runner.slots), "tok_s_12_layers_first_64": first,
            "tok_s_12_layers": 1 / dt, "tok_s_48_layers_extrapolated": 1 / (dt * 4),
            "hit_rate": e.runner.book.hit_rate(), "prefill_tok_s": e.last.prefill_tokens_per_s,
            **({"prefetched": e.runner.ahead.prefetched, "prefetch_hits": e.runner.ahead.prefetch_hits,
                "prefetch_late": e.runner.ahead.prefetch_late} if e.runner.ahead else {}),  # late: a miss, not a wait
            **{k: v for k, v in _against_nvml(e).items() if k in (
                "ledger_vs_nvml", "ledger_and_cache_vs_nvml", "beyond_plan_bytes", "nvml_used_bytes", "ledger_used_bytes",
                "torch_cached_bytes", "allocated_beyond_plan_bytes", "outside_torch_bytes")}}
        # the same without the slot-table kernels (the resident experts queued after the wait,
        # grouped, through the fused matvec): what queuing them early is worth
        row["tok_s_12_layers_grouped"] = _without(e, prompt, slot_table=True)
        row.update(_with_graphs(e, prompt))             # each layer's attention and router as one launch
        if share == 1.0:                        # ... and without any fused kernel: the torch path
            row["tok_s_12_layers_torch_path"] = _without(e, prompt, slot_table=True, matvec=True)
        if share == 0.25:                       # ... and without look-ahead: is a prefetch worth its copy here?
            row["tok_s_12_layers_no_look_ahead"] = _without_look_ahead(pack, device, share * total, prompt)
        if journal:
            journal.partial(out)
        del e
        torch.cuda.empty_cache()
    out["ok"] = out["rows"]["25%"]["tok_s_48_layers_extrapolated"] >= 40
    return out


def _without(e, prompt: list[int], slot_table: bool = False, matvec: bool = False) -> float:
    """Decode tok/s with the slot-table kernels (kernels/device_moe.py) and / or the grouped path's
    fused matvec (kernels/device_experts.py) off."""
    from moefit.kernels import device_experts, device_moe
    saved = device_moe.usable, device_experts.usable
    if slot_table:
        device_moe.usable = lambda *args: False
    if matvec:
        device_experts.usable = lambda *args: False
    try:
        e.generate(prompt, SamplingParams(max_tokens=64, temperature=1.0, seed=2, ignore_eos=True))
    finally:
        device_moe.usable, device_experts.usable = saved
    return e.last.decode_tokens_per_s


def _with_graphs(e, prompt: list[int]) -> dict:
    """Decode tok/s with --decode-graphs on (runtime/decode_graphs.py): a request that records
    the pieces, then one that replays them."""
    from moefit.runtime.decode_graphs import DecodeGraphs
    e.graphs = DecodeGraphs(e.model, e.loaded.mem.torch_device)
    try:
        e.generate(list(range(100, 164)), SamplingParams(max_tokens=64, temperature=1.0, seed=1, ignore_eos=True))
        e.generate(prompt, SamplingParams(max_tokens=64, temperature=1.0, seed=2, ignore_eos=True))
        return {"tok_s_12_layers_graphs": e.last.decode_tokens_per_s,
                "graphs": {k: v for k, v in e.decode_graphs_json().items() if k != "on"}}
    finally:
        e.graphs = None


def _without_look_ahead(pack: Path, device: str, slots: float, prompt: list[int]) -> float:
    """Decode tok/s of the same cache share with --prefetch-per-layer 0."""
    e = Engine.open(pack, cfg(device, expert_cache=str(int(slots)), prefetch_per_layer=0))
    e.generate(list(range(100, 164)), SamplingParams(max_tokens=64, temperature=1.0, seed=1, ignore_eos=True))
    e.generate(prompt, SamplingParams(max_tokens=64, temperature=1.0, seed=2, ignore_eos=True))
    return e.last.decode_tokens_per_s

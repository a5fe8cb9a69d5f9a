"""The device check: what only a GPU can answer, in one run of under 8 minutes, offline.

    python bench/gpu_check.py                       # on the GPU machine (make gpu-check)
    python bench/gpu_check.py --device sim:moefit/demo/card.json --quick   # the same checks, simulated

It needs torch and the engine only (no fastapi, uvicorn or pydantic) and writes
bench/results/gpu_check.json (after every check) and a table. Each check records what it
measured and passes or fails on the issue's goal. The checks run in a child process
(bench/isolated.py): one that raises, hangs past its limit or breaks the CUDA context is
recorded with its error, and a fresh child runs the rest within --budget-s:

  env          torch, CUDA, the card, the fused expert kernel, the host kernel and its threads
  greedy       the demo's greedy tokens on the device in fp32 equal the cpu's (the device's
               default dtype, bf16 on CUDA, is recorded beside them)
  cache        ... and do not change with the expert cache size (0, 8, auto), fp32 and default
  syncs        device->host waits per MoE layer per decode token: the hand-off's count, and
               on CUDA torch.cuda.set_sync_debug_mode's warnings (goal: <= 2)
  launches     CUDA kernel launches per decode token (torch.profiler; recorded, no goal)
  ledger       the plan against memory_allocated, memory_reserved and NVML (goal: within 2 %)
  auto         an --expert-cache auto start: slots, and free memory left against the reserve
  guard        shrink by 25 % of the cache and grow back: bytes given back to the driver
  prompt       the peak above the start's allocation during a 2,048-token prefill (chunks of 512)
               against the plan's prompt-path line (goal: within it)
  oom          another allocation takes the card mid-request: the request fails cleanly, the
               guard shrinks, the next request works
  graphs       --decode-graphs: the same greedy tokens with a decode step's pieces as without
               (bench/gpu_graphs.py), and gpt-oss's sinks and rings: each step's logits within 1e-5
  kernels      the slot-table kernels on the card, every kind of expert matrix they read and both
               expert functions, against fp32 (bench/gpu_kernels.py; goal: within 1e-5)
  decode       tok/s of a Qwen3-30B-A3B-shaped int4 pack (the first 12 of its 48 layers) under
               an emulated 12 GiB card with 25 / 50 / 100 % of its experts cached; a 48-layer
               figure is extrapolated as 12 / 48 of the per-token time (experts and attention
               scale with layers; the lm_head, ~4 % of a token, is counted 4 times: a lower bound);
               at 100 % also without the fused expert kernel (the torch path), to show its worth
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.isolated import Journal, run_isolated  # noqa: E402
from moefit.config import ServeConfig  # noqa: E402
from moefit.demo import demo_pack, sim_flag  # noqa: E402
from moefit.memory import ledger as L  # noqa: E402
from moefit.runtime.engine import Engine  # noqa: E402
from moefit.runtime.guard import Guard  # noqa: E402
from moefit.runtime.sampler import SamplingParams  # noqa: E402

MIB = 1 << 20
PROMPT = "a small domesticated carnivorous mammal with soft fur"
GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


def cfg(device: str, **over) -> ServeConfig:
    base = dict(device=device, ctx=2048, prefill_chunk=128)
    if device.startswith("sim:"):                       # the demo card's small-card flags
        base.update(vram_reserve_mib=int(sim_flag("--vram-reserve-mib")), low_headroom_mib=1, min_free_vram_mib=1,
                    grow_margin_mib=1)
    return ServeConfig(**{**base, **over})


def tokens(engine: Engine, n: int = 32) -> list[int]:
    prompt = engine.codec.encode(PROMPT)
    engine.generate(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    return list(engine.last.generated)


def check_greedy(device: str, pack) -> dict:
    """fp32 on both sides must agree token for token; the device's own default (bf16 on CUDA)
    is recorded, with where it first leaves the cpu's tokens."""
    want = tokens(Engine.open(pack, cfg("cpu")))
    got = tokens(Engine.open(pack, cfg(device, compute_dtype="fp32")))
    default = tokens(Engine.open(pack, cfg(device)))
    return {"ok": want == got, "cpu": want, "device": got, "first_difference": _first_difference(want, got),
            "device_default_dtype": default, "default_dtype_first_difference": _first_difference(want, default)}


def _first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def check_cache(device: str, pack) -> dict:
    """Greedy tokens with 0, 8 and auto experts resident, in fp32 and in the device's default."""
    runs = {f"{dtype}/{size}": tokens(Engine.open(pack, cfg(device, expert_cache=size, min_expert_slots=0,
                                                             compute_dtype=dtype)))
            for dtype in ("fp32", "auto") for size in ("0", "8", "auto")}
    same = {dtype: len({tuple(v) for k, v in runs.items() if k.startswith(dtype)}) == 1 for dtype in ("fp32", "auto")}
    return {"ok": all(same.values()), "same_tokens": same, "tokens": runs}


def check_syncs(device: str, pack) -> dict:
    engine = Engine.open(pack, cfg(device))
    engine.generate(engine.codec.encode(PROMPT), SamplingParams(max_tokens=4, temperature=0))   # warm
    out = watching_syncs(engine, device, lambda: engine.generate(engine.codec.encode(PROMPT), GREEDY))
    out.pop("result")
    out["ok"] = out["handoffs_per_moe_layer_token"] <= 2 and out.get("sync_debug_warnings_per_moe_layer_token", 0) <= 2
    return out


def watching_syncs(engine: Engine, device: str, run) -> dict:
    """run()'s result, with the hand-offs a MoE layer-token it made and, on CUDA, the
    synchronisations torch.cuda.set_sync_debug_mode warned of."""
    runner, layers = engine.runner, len(engine.pack.model.moe_layers)
    before, tokens_before = runner.handoffs, runner.tokens
    cuda = device.startswith("cuda")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            result = run()
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
    decoded = max(1, runner.tokens - tokens_before)
    synced = [str(w.message)[:120] for w in caught if "synchroniz" in str(w.message).lower()]
    out = {"result": result, "handoffs_per_moe_layer_token": (runner.handoffs - before) / decoded / layers,
           "tokens": decoded}
    if cuda:
        out["sync_debug_warnings_per_token"] = len(synced) / max(1, len(engine.last.generated))
        out["sync_debug_warnings_per_moe_layer_token"] = len(synced) / decoded / layers
        out["sync_debug_samples"] = sorted(set(synced))[:8]
    return out


def check_launches(device: str, pack) -> dict:
    """CUDA kernel and graph launches per decode token (torch.profiler's launch calls over 8
    tokens), without and with --decode-graphs: what the host issues each token."""
    if not device.startswith("cuda"):
        return {"ok": None, "skipped": "counts CUDA launches"}
    from torch.profiler import ProfilerActivity, profile
    out = {"ok": None, "moe_layers": len(Engine.open(pack, cfg(device)).pack.model.moe_layers)}
    for graphs in ("off", "on"):
        engine = Engine.open(pack, cfg(device, decode_graphs=graphs))
        engine.generate(engine.codec.encode(PROMPT), SamplingParams(max_tokens=4, temperature=0))   # warm
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        try:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                engine.generate(engine.codec.encode(PROMPT), params)
        except Exception as e:                      # a profiler that will not start is not a failed check
            return {"ok": None, "skipped": f"not measured: {type(e).__name__}: {e}"[:200]}
        n = max(1, len(engine.last.generated))
        counts = {ev.key: ev.count for ev in prof.key_averages() if "Launch" in ev.key}
        out[f"graphs_{graphs}"] = {"kernel_launches_per_token": sum(c for k, c in counts.items() if "Kernel" in k) / n,
                                   "graph_launches_per_token": sum(c for k, c in counts.items() if "Graph" in k) / n}
    return out


def check_ledger(device: str, pack) -> dict:
    """After a request: the pool is the cache line exactly, and what the card holds beyond the
    ledger's allocated lines (other processes, this one's CUDA context among them, taken at the
    start; dense; state; cache) fits in its reserve."""
    engine = Engine.open(pack, cfg(device, expert_cache="auto"))
    engine.generate(engine.codec.encode(PROMPT), GREEDY)
    plan, mem = engine.loaded.plan, engine.loaded.mem
    out = {"planned_device_bytes": plan.planned_device_bytes(), "charged_bytes": mem.total_charged(),
           "cache_line_bytes": plan.line(L.CACHE).bytes, "pool_bytes": engine.runner.pool.allocated}
    if device.startswith("cuda"):
        out.update(_against_nvml(engine))
        out["ok"] = out["beyond_plan_bytes"] <= out["reserve_bytes"] and out["cache_line_bytes"] == out["pool_bytes"]
    else:
        out["card_charged"] = mem.device.sim.charged
        out["ok"] = out["cache_line_bytes"] == out["pool_bytes"] and out["charged_bytes"] == plan.planned_device_bytes()
    return out


def _against_nvml(engine: Engine) -> dict:
    """The card as NVML sees it against the ledger: used = other processes (at the start) +
    the allocated lines + what the reserve is holding now."""
    plan, mem = engine.loaded.plan, engine.loaded.mem
    torch.cuda.synchronize()
    snap = mem.snapshot()
    used = snap.total_bytes - snap.free_bytes
    expected = plan.line(L.OTHER).bytes + plan.planned_device_bytes()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    # what is beyond the plan, split: torch's cache of freed blocks (the reserve's scratch, held
    # for the next prompt), tensors beyond the planned lines, and what is not torch's at all
    # (the context's growth since the start: cuBLAS, loaded kernels)
    split = {"torch_cached_bytes": reserved - allocated, "allocated_beyond_plan_bytes": allocated - sum(mem.charged.values()),
             "outside_torch_bytes": used - plan.line(L.OTHER).bytes - reserved}
    return {"nvml_used_bytes": used, "ledger_used_bytes": expected, "reserve_bytes": plan.reserve.total,
            "beyond_plan_bytes": used - expected, "ledger_vs_nvml": (used - expected) / used,
            "ledger_and_cache_vs_nvml": (used - expected - split["torch_cached_bytes"]) / used, **split,
            "memory_allocated": allocated, "memory_reserved": reserved,
            "nvml_this_process": next((p.bytes for p in snap.processes if p.pid == _pid()), None)}


def check_auto(device: str, pack) -> dict:
    engine = Engine.open(pack, cfg(device, expert_cache="auto"))
    plan = engine.loaded.plan
    free = engine.loaded.mem.snapshot().free_bytes
    return {"ok": len(engine.runner.slots) >= plan.min_slots and free >= plan.reserve.total - plan.reserve.draft,
            "slots": len(engine.runner.slots), "planned_slots": plan.slots, "free_mib": free / MIB,
            "reserve_mib": plan.reserve.total / MIB, "notes": engine.loaded.notes}


def check_guard(device: str, pack) -> dict:
    engine = Engine.open(pack, cfg(device, expert_cache="auto"))
    guard = _guard(engine)
    mem, pool = engine.loaded.mem, engine.runner.pool
    free0, slots0 = mem.snapshot().free_bytes, len(engine.runner.slots)
    freed = guard.shrink(pool.allocated // 4, "gpu_check")
    free1, slots1 = mem.snapshot().free_bytes, len(engine.runner.slots)
    guard.grow(free1 - free0 + pool.allocated)
    free2, slots2 = mem.snapshot().free_bytes, len(engine.runner.slots)
    back = free1 - free0
    return {"ok": freed > 0 and back >= 0.9 * freed and slots2 > slots1, "slots": [slots0, slots1, slots2],
            "freed_by_pool_mib": freed / MIB, "driver_saw_mib": back / MIB, "free_after_grow_mib": free2 / MIB,
            "tokens_after": tokens(engine, 8)}


def check_prompt(device: str, pack) -> dict:
    engine = Engine.open(pack, cfg(device, ctx=4096, prefill_chunk=512))
    prompt = (engine.codec.encode(PROMPT + " ") * 400)[:2048]
    line = engine.loaded.plan.reserve.prompt
    if not device.startswith("cuda"):
        engine.prefill(prompt)
        return {"ok": None, "skipped": "the peak needs CUDA's allocator statistics", "prompt_line_mib": line / MIB}
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    engine.prefill(prompt)
    peak = torch.cuda.max_memory_allocated() - base
    return {"ok": peak <= line, "peak_mib": peak / MIB, "prompt_line_mib": line / MIB, "ratio": peak / line}


def check_oom(device: str, pack) -> dict:
    engine = Engine.open(pack, cfg(device, expert_cache="auto"))
    guard = _guard(engine)
    want = tokens(engine, 8)
    hog = _take_the_card(engine)
    error = None
    try:
        tokens(engine, 8)
    except Exception as e:  # noqa: BLE001 - what a request sees is the point
        error = f"{type(e).__name__}: {e}"[:200]
        if "OutOfMemory" in type(e).__name__:
            guard.after_oom(e)
    hog.release()
    after = tokens(engine, 8)
    return {"ok": error is not None and "OutOfMemory" in error and after == want, "error": error,
            "slots_after": len(engine.runner.slots), "tokens_match_after": after == want}


def _guard(engine: Engine) -> Guard:
    return Guard(engine, engine.cfg.min_free_vram_mib * MIB, engine.cfg.grow_margin_mib * MIB)


class _Hog:
    def __init__(self, release):
        self.release = release


def _take_the_card(engine: Engine) -> _Hog:
    """Another program takes all but a few MiB of free memory (and the engine's cached blocks)."""
    mem = engine.loaded.mem
    if mem.device.kind == "cuda":
        torch.cuda.empty_cache()
        blocks, size = [], 1 << 30
        while size >= 512:                      # the driver keeps some for itself: take what it gives,
                                                # down to the free space of torch's small-block segments
            try:
                blocks.append(torch.empty(size, dtype=torch.uint8, device=mem.torch_device))
            except torch.OutOfMemoryError:
                size //= 2
        return _Hog(lambda: (blocks.clear(), torch.cuda.empty_cache()))
    card = json.loads(mem.device.sim.path.read_text())
    original = json.dumps(card)
    card["processes"].append({"pid": 99999, "name": "gpu_check hog",
                              "used_mib": mem.snapshot().free_bytes / MIB + 0.5})
    mem.device.sim.path.write_text(json.dumps(card))
    return _Hog(lambda: mem.device.sim.path.write_text(original))


def check_env(device: str, pack) -> dict:
    """What ran: torch, the card, the fused kernel, the host kernel, the cores."""
    import os
    from moefit import kernels
    out = {"ok": None, "torch": torch.__version__, "cuda": torch.version.cuda, "cpus": os.cpu_count(),
           "host_kernel": f"loaded ({kernels.isa()})" if kernels.library() is not None else "absent: torch path",
           "threads": kernels.default_threads(),
           "fused_expert_kernel": _fused_kernel()}
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(0)
        out.update(gpu=props.name, gpu_mib=props.total_memory // MIB, capability=f"{props.major}.{props.minor}")
    return out


def _pid() -> int:
    import os
    return os.getpid()


CHECKS = {"env": check_env, "greedy": check_greedy, "cache": check_cache, "syncs": check_syncs,
          "ledger": check_ledger, "auto": check_auto, "guard": check_guard, "prompt": check_prompt, "oom": check_oom,
          "launches": check_launches}
LIMIT_S = {"decode": 330, "launches": 60, "kernels": 150}   # seconds a check may run; the rest get isolated's 120


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="skip the 30B-shaped decode measurement")
    ap.add_argument("--only", help="comma-separated checks")
    ap.add_argument("--budget-s", type=float, default=450, help="the whole run's seconds (default 450)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "gpu_check.json"))
    ap.add_argument("--pack-dir", help="where the decode check's 30B-shaped pack is built (kept; default a temp dir)")
    ap.add_argument("--decode-quant", default="int4", help="its experts: int4, or a GGUF file's kept super-blocks "
                    "(q4_k/q6_k: a Q4_K_M file's, bench/synthetic_pack.py)")
    ap.add_argument("--child", help=argparse.SUPPRESS)      # the journal of a child that runs the checks
    args = ap.parse_args(argv)
    if args.child:
        return run_child(args)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device here: run it on the GPU machine, or with --device sim:moefit/demo/card.json")
        return 2
    if args.device.startswith("sim:"):                 # the guard's and oom's checks write the card: a copy
        copy = Path(tempfile.mkdtemp()) / Path(args.device[4:]).name
        copy.write_text(Path(args.device[4:]).read_text())
        args.device = f"sim:{copy}"
    demo_pack(log=print)                               # packed once, before the children read it
    names = args.only.split(",") if args.only else [n for n in CHECKS if n != "launches"] + [
        "graphs", "kernels", "decode", "launches"]
    report = {"device": args.device, "started": time.strftime("%Y-%m-%d %H:%M:%S"), "checks": {}}

    def landed(name: str, result: dict) -> None:
        report["checks"][name] = result
        print(f"{name:<8} {_verdict(result['ok']):<5} {result.get('seconds', 0):>6.1f} s  {_summary(result)}", flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1, default=str))

    def child(todo: list[str], journal: Path) -> list[str]:
        return [sys.executable, __file__, "--child", str(journal), "--device", args.device, "--only", ",".join(todo)] + (
            ["--quick"] if args.quick else []) + (["--pack-dir", args.pack_dir] if args.pack_dir else []) + [
            "--decode-quant", args.decode_quant]

    started = time.time()
    results = run_isolated(child, names, LIMIT_S, args.budget_s, landed)
    print(f"wrote {args.out} ({time.time() - started:.0f} s)")
    return 0 if all(r["ok"] is not False for r in results.values()) else 1


def run_child(args) -> int:
    """Run the named checks in this process, journalling each as it starts and lands."""
    from bench.gpu_decode import check_decode          # they import this module's helpers
    from bench.gpu_graphs import check_graphs
    from bench.gpu_kernels import check_kernels
    checks = {**CHECKS, "graphs": check_graphs, "kernels": check_kernels}
    journal, pack = Journal(args.child), demo_pack(log=print)
    for name in args.only.split(","):
        journal.start(name)
        t = time.time()
        try:
            result = (check_decode(args.device, args.quick, journal, args.pack_dir, args.decode_quant) if name == "decode"
                      else checks[name](args.device, pack))
        except Exception as e:  # noqa: BLE001 - one broken check must not hide the others
            result = {"ok": False, "error": f"{type(e).__name__}: {e}"[:500], "trace": traceback.format_exc()[-2000:]}
        result["seconds"] = round(time.time() - t, 1)
        journal.done(name, result)
    return 0


def _fused_kernel() -> str:
    """Whether the resident experts' fused kernel (kernels/device_experts.py) was there to run."""
    from moefit.kernels import device_experts
    module = device_experts._kernel()
    if module is None:
        return "absent: the torch path ran"
    if device_experts.broken is not None:
        return f"triton {module.triton.__version__} did not compile it: {device_experts.broken}"
    return f"triton {module.triton.__version__}"


def _verdict(ok) -> str:
    return {True: "ok", False: "FAIL", None: "skip"}[ok]


def _summary(r: dict) -> str:
    keep = {k: v for k, v in r.items() if k not in ("ok", "seconds", "trace", "tokens", "cpu", "device", "rows",
                                                 "device_default_dtype")}
    if "rows" in r:
        keep["rows"] = {k: round(v["tok_s_48_layers_extrapolated"], 1) for k, v in r["rows"].items()}
    return json.dumps(keep, default=str)[:200]


if __name__ == "__main__":
    sys.exit(main())

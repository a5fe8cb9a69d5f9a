"""Load: snapshot -> plan -> place dense weights, KV and reserve -> fill the expert cache
hottest first. Every byte goes through DeviceMemory under its ledger line.
"""

from __future__ import annotations

import dataclasses

from dataclasses import dataclass

import torch

from moefit.config import ServeConfig
from moefit.errors import DeviceOutOfMemory, RefusedError, UsageError
from moefit.experts.cache import CacheBook, SwapPolicy
from moefit.experts.profile import Profile, no_profile_note
from moefit import kernels
from moefit.experts import host_panels, probe
from moefit.experts.lookahead import LookAhead
from moefit.experts.costs import MissCosts, measure_pcie
from moefit.experts.pool import SlotPool
from moefit.experts.slot_table import SlotTable
from moefit.experts.runner import ExpertRunner
from moefit.families.common import rope_dim
from moefit.memory import ledger as L
from moefit.memory.devices import host_available_bytes, open_device
from moefit.memory.footprint import device_dense_names, from_pack_header
from moefit.memory.planner import Plan, plan
from moefit.models import FAMILY
from moefit.models.layers import Weights
from moefit.models.rope import RopeTable
from moefit.pack.quant import TORCH_DTYPES
from moefit.pack.reader import Pack
from moefit.runtime.state import SequenceState
from moefit.runtime.placement import DeviceMemory


@dataclass
class Loaded:
    pack: Pack
    mem: DeviceMemory
    plan: Plan | None                   # None on the cpu device (no VRAM to plan)
    model: object
    states: list[SequenceState]         # one a session (--sessions), each charged to the sequence state line
    runner: ExpertRunner
    compute_dtype: str
    notes: list[str]

    @property
    def kv(self) -> SequenceState:
        """The first session's sequence state (its shape is every session's)."""
        return self.states[0]


def compute_dtype_for(cfg: ServeConfig, kind: str) -> str:
    if cfg.compute_dtype != "auto":
        return cfg.compute_dtype
    return "bf16" if kind == "cuda" else "fp32"


def load(pack: Pack, cfg: ServeConfig, log=lambda msg: None) -> Loaded:
    """Place the pack on cfg.device as the plan says; RefusedError when it does not fit."""
    if cfg.expert_gemm_rows not in ("auto", "off") and not (cfg.expert_gemm_rows.isdigit() and int(cfg.expert_gemm_rows)):
        raise UsageError(f"--expert-gemm-rows {cfg.expert_gemm_rows}: auto, off or a number of rows")
    host_panels.check_setting(cfg.host_panels)
    if cfg.sessions < 1:
        raise UsageError(f"--sessions {cfg.sessions}: at least one session holds the sequence state")
    device = open_device(cfg.device)
    if device.kind == "cuda" and cfg.dense_quant != "off":
        raise UsageError(f"--dense-quant {cfg.dense_quant} runs the dense matrices in the host kernel; on CUDA it "
                         "would build a bf16 copy of each matrix per call (594 MiB for Qwen3's lm_head) that the "
                         "ledger does not hold: leave it off on CUDA (the dense weights are bf16 there)")
    mem = DeviceMemory(device)
    if device.kind == "cuda":
        torch.zeros(1, device=mem.torch_device)          # create the context before the snapshot
    set_threads(cfg)
    cdt = compute_dtype_for(cfg, device.kind)
    m = pack.model
    profile = Profile.load(pack.profile_path, m.num_layers, m.num_experts)
    the_plan = _plan(pack, cfg, mem, cdt, profile) if device.has_vram else None
    if the_plan is not None and profile.is_empty:
        the_plan = dataclasses.replace(the_plan, serve_message=f"{the_plan.serve_message}; "
                                       f"{no_profile_note(the_plan.slots, the_plan.total_experts)}")
    if the_plan is not None and the_plan.refused:
        raise RefusedError(refusal_text(the_plan), the_plan)
    try:
        return _place(pack, cfg, mem, cdt, the_plan, profile, device.kind, log)
    except DeviceOutOfMemory as e:          # the card filled up after the plan: refuse, with the ledger
        if the_plan is None:
            raise
        raise RefusedError(refusal_text(the_plan, extra=str(e)), the_plan) from None


def _place(pack: Pack, cfg: ServeConfig, mem: DeviceMemory, cdt: str, the_plan: Plan | None, profile: Profile,
           kind: str, log) -> Loaded:
    m = pack.model
    dtype = TORCH_DTYPES[cdt]
    place = lambda name, t, keep=False: mem.copy_in(  # noqa: E731  (int4 scales stay fp16: the kernel reads them)
        L.DENSE, t, dtype if t.is_floating_point() and not keep else None)
    weights = Weights(device_dense_names(m, pack.dense_names), pack.dense, place, cfg.dense_quant,
                      narrow_routers=the_plan is None and dtype is torch.float32)    # the cpu device: no ledger plan
    rope = _rope(m, cfg.ctx, mem, dtype)
    model = FAMILY[m.family](m, weights, rope)
    kv_dtype = the_plan.kv_dtype if the_plan else (cdt if cfg.kv_dtype == "auto" else cfg.kv_dtype)
    resident = the_plan.kv_resident if the_plan else cfg.resident_tokens()
    states = [SequenceState(m, cfg.ctx, kv_dtype, dtype, mem, cfg.prefill_chunk, resident) for _ in range(cfg.sessions)]
    book = CacheBook({k: b.nbytes for k, b in pack.model_blobs.items()}, m.num_layers, m.num_experts,
                     the_plan.cache_budget if the_plan else 0,
                     SwapPolicy(cfg.swap_period, cfg.swap_decay, cfg.max_swaps))
    runner = ExpertRunner(pack, mem, book, profile, SlotPool(mem, book.sizes, m.num_layers, m.num_experts))
    runner.table = SlotTable(mem.empty(L.DENSE, (m.num_layers, m.num_experts), torch.int64))
    if the_plan is not None:
        runner.group, runner.slice_weights = the_plan.resident_group, the_plan.expert_slice
    runner.rates.setting = cfg.expert_gemm_rows
    runner.panels = host_panels.HostPanels(host_panels.budget_bytes(
        cfg.host_panels, sum(b.nbytes for b in pack.blobs.values() if b.quant == "int4"), host_available_bytes() or 0))
    runner.panels.maker = lambda job: runner.staging().call(job)   # copies made off the engine thread
    runner.expert_fn = getattr(model, "expert", None)      # a family's own expert (gpt-oss), else SwiGLU
    runner.native_act = getattr(model, "native_act", None)
    runner.group_act = getattr(model, "group_act", None)
    runner.fused.act = getattr(model, "fused_act", None)     # ... and for the slot-table kernels
    notes = []
    if the_plan is not None:
        if cfg.prefetch_per_layer > 0:            # the look-ahead's trained probe, in the dense line
            model.probes = probe.load(pack, lambda t: mem.copy_in(L.DENSE, t, dtype))
        notes = fill_cache(runner, the_plan, kind, log)
        if cfg.prefetch_per_layer > 0:            # a device with an expert cache: look ahead
            runner.ahead = LookAhead(m.num_layers, cfg.prefetch_per_layer, m.top_k, probe_layers=sorted(model.probes),
                                     moe_layers=list(m.moe_layers))
            # on CUDA a late copy is a miss computed on the host, not a wait for the worker's staging
            # memcpy; a simulated card's copy takes the host's own cores, so it waits (and its counts
            # do not depend on thread timing)
            runner.wait_for_prefetch = kind != "cuda"
        runner.costs = miss_costs(runner, cfg, mem)
    return Loaded(pack, mem, the_plan, model, states, runner, cdt, notes)


def miss_costs(runner: ExpertRunner, cfg: ServeConfig, mem: DeviceMemory) -> MissCosts:
    """The rates the PCIe-or-host choice uses: given, or measured here (experts/costs.py)."""
    costs = MissCosts()
    if cfg.pcie_gbps is not None:
        costs.pcie_bytes_per_s = cfg.pcie_gbps * 1e9
    elif mem.device.kind == "cuda":
        costs.pcie_bytes_per_s = measure_pcie(mem.torch_device)
    if costs.enabled:
        measured_bw, costs.host_macs_per_s = runner.rates.measure()
        costs.host_bytes_per_s = cfg.host_expert_gbps * 1e9 if cfg.host_expert_gbps else measured_bw
        costs.gemm_bytes_per_s, costs.gemm_macs_per_s = runner.rates.measure(gemm=True)
    return costs


def set_threads(cfg: ServeConfig) -> None:
    """The native pool gets --threads (default: the physical cores). torch keeps one thread when
    the dense matrices run in the pool too (--dense-quant): measured on 2 cores (big shape of
    bench/decode.py, int4 + dense int4), torch's OpenMP threads spinning after each op slowed
    the pool's dense matrices from 15.0 to 20.8 ms a token (24.5 against 21.4 tok/s). With the
    dense path in torch, torch gets the threads: its prefill GEMMs use them. On CUDA torch's host
    operations are the routing's few numbers (a prompt's expert GEMMs raise the threads for
    themselves: kernels.torch_threads): one thread, so none spins beside the pool (on the H200
    machine's 16 cores, a 25 %-cached decode's small host operations took 1.6 ms each with them)."""
    n = cfg.threads or kernels.default_threads()
    kernels.set_threads(n)
    single = kernels.library() is not None and (cfg.dense_quant != "off" or cfg.device.startswith("cuda"))
    torch.set_num_threads(1 if single else n)


def _plan(pack: Pack, cfg: ServeConfig, mem: DeviceMemory, cdt: str, profile: Profile) -> Plan:
    fp = from_pack_header(pack.header, cdt, cfg.dense_quant)
    return plan(fp, cfg, mem.snapshot(), profile.hottest_first(list(pack.model_blobs)), host_available_bytes())


def _rope(m, ctx: int, mem: DeviceMemory, dtype) -> RopeTable:
    rope = RopeTable(m.rope, rope_dim(m), m.max_position_embeddings, "cpu", dtype)
    rope.inv_freq = mem.copy_in(L.DENSE, rope.inv_freq)
    return rope


def fill_cache(runner: ExpertRunner, the_plan: Plan, kind: str, log) -> list[str]:
    """Allocate the planned pool and load the planned experts into it, hottest first. If the
    card filled up since the plan, the pool stops at the chunk that would eat into the reserve
    (free memory held back for the prompt path and the verify arena; only a draft head is
    allocated in it), and chunks are given back while the reserve is short."""
    notes = []
    keep_free = the_plan.reserve.total - the_plan.reserve.draft
    made = runner.pool.reserve(the_plan.cache_keys, keep_free)
    for key in the_plan.cache_keys:
        if runner.pool.free_slots(key):
            runner.load(key)
    if made < len(the_plan.cache_keys):
        notes.append(f"the card filled up while the cache loaded (its slot pool got {made} of "
                     f"{len(the_plan.cache_keys)} slots); started with {len(runner.slots)} of {the_plan.slots} "
                     "planned experts")
    short = keep_free - runner.mem.snapshot().free_bytes
    if short > 0:
        runner.give_back(short)
        runner.mem.release_cached()
        notes.append("free memory fell below the reserve after the cache loaded; the cache shrank")
    runner.book.budget = runner.book.used if notes else runner.book.budget
    if len(runner.slots) < the_plan.min_slots:
        raise RefusedError(refusal_text(the_plan, extra=notes[0] if notes else ""), the_plan)
    for note in notes:
        log(note)
    return notes


def refusal_text(p: Plan, extra: str = "") -> str:
    top = sorted(p.device.processes, key=lambda x: -x.bytes)[:5]
    lines = [f"refused: {p.serve_message}" + (f"; {extra}" if extra else ""), "", p.table(), "",
             "processes holding the most memory:"]
    lines += [f"  pid {x.pid:>7}  {x.name:<24} {L.mib(x.bytes):>8,.0f} MiB" for x in top] or ["  (none listed)"]
    lines += ["", "fixes:"] + [f"  - {f}" for f in p.fixes]
    return "\n".join(lines)

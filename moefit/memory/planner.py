"""The planner: a pure function of (model footprint, operator's config, device snapshot,
hotness order) -> Plan. `moefit plan` and every start print the same ledger.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moefit.config import ServeConfig
from moefit.experts.cache import fill
from moefit.experts.slots import fit, pool_bytes, slots_bytes, slots_fitting
from moefit.memory import ledger as L
from moefit.families.state import PROMPT_MARKS
from moefit.memory.devices import DeviceSnapshot
from moefit.memory.footprint import Footprint, Key

MIB = L.MIB
HEADROOM_MIB = 512
SPEED_RESERVE_MIB = 512


@dataclass(frozen=True)
class Reserve:
    total: int
    prompt: int
    verify: int
    draft: int
    recommended: int
    graphs: int = 0                  # --decode-graphs' rows (runtime/decode_graphs.py), at most

    @property
    def headroom(self) -> int:
        return self.total - self.prompt - self.verify - self.draft - self.graphs


@dataclass(frozen=True)
class Plan:
    device: DeviceSnapshot
    lines: list[L.Line]
    reserve: Reserve
    kv_dtype: str
    kv_resident: int | None          # KV streaming: tokens of each streaming layer on the card
    host_state_bytes: int            # ... and the whole context of those layers in host memory
    cache_budget: int
    cache_keys: list[Key]
    cache_used: int
    largest_blob: int
    min_slots: int
    total_experts: int
    serve_status: str                 # OK | LOW | REFUSED
    serve_message: str
    spec_enabled: bool
    spec_mode: str
    spec_reason: str
    fixes: list[str] = field(default_factory=list)
    host_free_bytes: int | None = None  # RAM available when planned (KV streaming's host part is checked against it)
    resident_group: int = 1             # resident experts a device step multiplies at once ...
    expert_slice: int = 1 << 62         # ... in row slices of at most this many weights (the scratch is planned)
    host_mark_bytes: int = 0            # the recurrent layers' states at the last prompts' ends, in host memory

    @property
    def refused(self) -> bool:
        return self.serve_status == "REFUSED"

    @property
    def slots(self) -> int:
        return len(self.cache_keys)

    def line(self, name: str) -> L.Line:
        return next(x for x in self.lines if x.name == name)

    def planned_device_bytes(self) -> int:
        """What moefit allocates on the card once started. The reserve is free memory held
        back for the prompt path and the verify arena; only a draft source's weights (a head, or
        the MTP layers and their KV) are allocated in it."""
        return sum(self.line(n).bytes for n in (L.DENSE, L.KV, L.CACHE)) + self.reserve.draft

    def table(self) -> str:
        """The card's ledger, and under it the host memory KV streaming holds, when it does."""
        card = L.render(self.lines, self.device.total_bytes, f"{self.device.name} (total)")
        parts = [f"the sequence state before each layer's last {self.kv_resident} tokens (KV streaming)"] \
            if self.kv_resident else []
        if self.host_mark_bytes:
            parts.append(f"the recurrent layers' state at the last {PROMPT_MARKS} prompts' ends (a chat's next turn "
                         "resumes there)")
        if not parts:
            return card
        available = f" of {L.mib(self.host_free_bytes):,.0f} MiB available" if self.host_free_bytes else ""
        return (f"{card}\nhost memory: {L.mib(self.host_state_bytes + self.host_mark_bytes):,.0f} MiB{available} "
                f"for {' and '.join(parts)}")

    def to_json(self) -> dict:
        return {
            "device": device_json(self.device),
            "ledger": [x.to_json() for x in self.lines],
            "expert_cache": {"slots": self.slots, "budget_bytes": self.cache_budget,
                             "used_bytes": self.cache_used, "largest_blob_bytes": self.largest_blob,
                             "min_slots": self.min_slots, "total_experts": self.total_experts},
            "reserve": {"bytes": self.reserve.total, "recommended_bytes": self.reserve.recommended,
                        "is_recommended": self.reserve.total == self.reserve.recommended},
            "kv_dtype": self.kv_dtype,
            "kv_streaming": {"resident_tokens": self.kv_resident, "host_bytes": self.host_state_bytes},
            "prompt_marks": {"count": PROMPT_MARKS if self.host_mark_bytes else 0, "host_bytes": self.host_mark_bytes},
            "serve_check": {"status": self.serve_status, "headroom_bytes": self.reserve.headroom,
                            "message": self.serve_message},
            "speculative": {"enabled": self.spec_enabled, "mode": self.spec_mode, "reason": self.spec_reason},
            "fixes": self.fixes,
            "resident_group": self.resident_group,
            "expert_slice": self.expert_slice,
        }


def device_json(d: DeviceSnapshot) -> dict:
    return {"name": d.name, "total_bytes": d.total_bytes, "free_bytes": d.free_bytes,
            "processes": [{"pid": p.pid, "name": p.name, "bytes": p.bytes} for p in d.processes]}


def resolve_kv_dtype(cfg: ServeConfig, compute_dtype: str) -> str:
    return compute_dtype if cfg.kv_dtype == "auto" else cfg.kv_dtype


def plan_reserve(fp: Footprint, cfg: ServeConfig, kv_dtype: str, spec_on: bool, resident: int | None = None,
                 group: tuple[int, int] = (1, 1 << 62)) -> Reserve:
    prompt = fp.prompt_path_bytes(cfg.prefill_chunk, cfg.ctx, kv_dtype, resident, group)
    verify = fp.verify_arena_bytes(cfg.spec_window) if cfg.spec != "off" else 0
    draft = fp.draft_bytes(spec_mode(cfg.spec, fp), cfg.ctx, kv_dtype, cfg.prefill_chunk, resident, cfg.sessions)
    graphs = fp.decode_graph_bytes(cfg.ctx, graph_windows(cfg), cfg.prefill_chunk, cfg.sessions) \
        if cfg.decode_graphs == "on" else 0
    recommended = _round_mib(prompt + verify + draft + graphs + HEADROOM_MIB * MIB)
    if cfg.vram_reserve_mib is not None:
        total = cfg.vram_reserve_mib * MIB
    else:
        total = SPEED_RESERVE_MIB * MIB if cfg.tier == "speed" else recommended
    if not spec_on:
        verify = draft = 0
    return Reserve(total, prompt, verify, draft, recommended, graphs)


def graph_windows(cfg: ServeConfig) -> list[int]:
    """The verify windows' lengths --decode-graphs records pieces for (a draft of 1..spec_window
    tokens, verified with the token before it)."""
    return list(range(2, cfg.spec_window + 2)) if cfg.spec != "off" else []


def _round_mib(n: int) -> int:
    return -(-n // MIB) * MIB


NO_HEAD = "the pack has no draft head (train one with `moefit train-draft`, or use --spec lookup)"
NO_MTP = "the pack has no MTP layers (its checkpoint had none, or the family has none: use --spec lookup)"


def spec_mode(spec: str, fp: Footprint | None = None, has_head: bool = False, mtp_layers: int = 0) -> str:
    """The draft source --spec names; auto: the pack's MTP layers, else its draft head, else
    prompt lookup."""
    if fp is not None:
        has_head, mtp_layers = bool(fp.draft_head_bytes), fp.mtp_layers
    if spec != "auto":
        return spec
    return "mtp" if mtp_layers else "head" if has_head else "lookup"


def speculative(fp: Footprint, cfg: ServeConfig, kv_dtype: str, group: tuple[int, int] = (1, 1 << 62)
                ) -> tuple[bool, str]:
    """Whether the verify arena and the draft source's weights fit the reserve, and why not."""
    if cfg.spec == "off":
        return False, "--spec off"
    if cfg.spec == "head" and not fp.draft_head_bytes:
        return False, NO_HEAD
    if cfg.spec == "mtp" and not fp.mtp_layers:
        return False, NO_MTP
    mode = spec_mode(cfg.spec, fp)
    what = "MTP layers (weights and KV)" if mode == "mtp" else "draft head"
    want = plan_reserve(fp, cfg, kv_dtype, spec_on=True, group=group)
    short = -(want.headroom)
    if short > 0:
        need = _round_mib(want.prompt + want.verify + want.draft)
        return False, (f"the verify arena ({L.mib(want.verify):.0f} MiB) and {what} ({L.mib(want.draft):.0f} "
                       f"MiB) fall {L.mib(short):.0f} MiB short in a {L.mib(want.total):.0f} MiB reserve; "
                       f"a reserve of {L.mib(need) + 1:.0f} MiB or more fits them")
    return True, f"{mode}: window {cfg.spec_window}, verify arena and {what} fit the reserve"


def plan(fp: Footprint, cfg: ServeConfig, snap: DeviceSnapshot, order: list[Key],
         host_free: int | None = None) -> Plan:
    """The ledger of a start: where every byte of the card goes, and whether it fits.
    `host_free` (bytes of RAM available), when given, is checked against KV streaming's host part.

    Usage: p = plan(footprint, ServeConfig(ctx=131072), device.snapshot(), profile.hottest_first(keys))
    """
    kv_dtype = resolve_kv_dtype(cfg, fp.compute_dtype)
    group = fp.resident_group(snap.total_bytes)
    spec_on, spec_reason = speculative(fp, cfg, kv_dtype, group)
    min_slots = cfg.min_expert_slots if cfg.min_expert_slots is not None else fp.min_slots
    resident = resident_window(fp, cfg, snap, kv_dtype, spec_on, min_slots, group)
    reserve = plan_reserve(fp, cfg, kv_dtype, spec_on, resident, group)
    dense = device_dense(fp, cfg)
    kv = fp.state_bytes(cfg.ctx, kv_dtype, cfg.prefill_chunk, resident) * cfg.sessions
    host = fp.host_state_bytes(cfg.ctx, kv_dtype, resident) * cfg.sessions
    if spec_on and spec_mode(cfg.spec, fp) == "mtp":
        host += fp.mtp_host_bytes(cfg.ctx, kv_dtype, resident) * cfg.sessions
    marks = fp.host_mark_bytes() * cfg.sessions
    other = snap.total_bytes - snap.free_bytes
    available = snap.free_bytes - dense - kv - reserve.total
    budget = _cache_budget(cfg, fp, available)
    room = max(0, min(budget, available))
    keys = fit(fill(order, fp.blob_sizes, room), fp.blob_sizes, room)
    used = pool_bytes(keys, fp.blob_sizes)            # the slot pool's allocation, chunk by chunk
    lines = [L.Line(L.OTHER, other), L.Line(L.DENSE, dense), _state_line(kv, cfg.ctx, kv_dtype, resident, host, cfg.sessions),
             _reserve_line(reserve), L.Line(L.CACHE, used, note=f"{len(keys)} experts"),
             L.Line(L.FREE, snap.free_bytes - dense - kv - reserve.total - used)]
    status, message, fixes = _serve_check(fp, cfg, snap, reserve, budget, available, len(keys), min_slots, kv_dtype)
    status, message, fixes = _host_check(status, message, fixes, cfg, resident, host, host_free)
    return Plan(snap, lines, reserve, kv_dtype, resident, host, budget, keys, used, fp.largest_blob, min_slots,
                len(fp.blob_sizes), status, message, spec_on and status != "REFUSED", cfg.spec, spec_reason, fixes,
                host_free, *group, marks)


def device_dense(fp: Footprint, cfg: ServeConfig) -> int:
    """The dense line: the dense weights, RoPE's frequencies, the expert cache's slot table, and the
    look-ahead's probe when it looks ahead."""
    return (fp.dense_bytes + fp.rope_bytes(cfg.ctx) + fp.slot_table_bytes
            + (fp.probe_bytes if cfg.prefetch_per_layer > 0 else 0))


WINDOW_STEP = 1024


def resident_window(fp: Footprint, cfg: ServeConfig, snap: DeviceSnapshot, kv_dtype: str, spec_on: bool,
                    min_slots: int, group: tuple[int, int] = (1, 1 << 62)) -> int | None:
    """KV streaming's window: None (the whole context on the card), --kv-resident N, or with
    auto, when the whole context would leave the expert cache below its minimum, the largest
    window (a multiple of 1024 tokens, at least a prefill chunk) that leaves it that minimum."""
    if cfg.kv_resident != "auto":
        n = cfg.resident_tokens()
        return None if n is None or n >= cfg.ctx else max(n, cfg.prefill_chunk)
    streaming_per_token = sum(s.bytes_per_token(kv_dtype) for s in fp.states if s.streams) * cfg.sessions
    if not streaming_per_token:
        return None
    need = slots_bytes(min_slots, fp.largest_blob)
    left = lambda w: (snap.free_bytes - device_dense(fp, cfg)  # noqa: E731
                      - fp.state_bytes(cfg.ctx, kv_dtype, cfg.prefill_chunk, w) * cfg.sessions
                      - plan_reserve(fp, cfg, kv_dtype, spec_on, w, group).total)
    if left(None) >= need:
        return None
    window = (left(0) - need) // streaming_per_token // WINDOW_STEP * WINDOW_STEP
    while window >= cfg.prefill_chunk and left(window) < need:
        window -= WINDOW_STEP
    return int(window) if cfg.prefill_chunk <= window < cfg.ctx else None


def _state_line(kv: int, ctx: int, kv_dtype: str, resident: int | None, host: int, sessions: int) -> L.Line:
    each = f"{sessions} sessions x " if sessions > 1 else ""
    if resident is None:
        return L.Line(L.KV, kv, note=f"{each}{ctx} x {kv_dtype}")
    return L.Line(L.KV, kv, note=f"{each}{resident} of {ctx} tokens x {kv_dtype}; {L.mib(host):,.0f} MiB in host memory")


def _host_check(status, message, fixes, cfg: ServeConfig, resident, host: int, host_free: int | None):
    if resident is None:
        return status, message, fixes
    if host_free is not None and host > host_free and status != "REFUSED":
        return "REFUSED", (f"KV streaming keeps {L.mib(host):,.0f} MiB of older KV in host memory, "
                           f"{L.mib(host_free):,.0f} MiB is available"), [
            f"--ctx {max(cfg.prefill_chunk, cfg.ctx * host_free // host // 256 * 256)} fits in RAM",
            "--kv-dtype q4 stores a quarter of bf16"]
    note = (f"KV streaming: {resident} of {cfg.ctx} tokens per full-attention layer on the card, "
            f"{L.mib(host):,.0f} MiB in host memory; attention over the older tokens runs on the host")
    return status, f"{message}; {note}", fixes


def _cache_budget(cfg: ServeConfig, fp: Footprint, available: int) -> int:
    if cfg.expert_cache == "auto":                  # every expert, as the pool allocates them (slots are aligned)
        return max(0, min(available, pool_bytes(list(fp.blob_sizes), fp.blob_sizes)))
    return slots_bytes(int(cfg.expert_cache), fp.largest_blob)


def _reserve_line(r: Reserve) -> L.Line:
    note = "recommended" if r.total == r.recommended else f"recommended: {L.mib(r.recommended):.0f} MiB"
    parts = (L.Line(L.PROMPT, r.prompt), L.Line(L.VERIFY, r.verify), L.Line(L.DRAFT, r.draft),
             *((L.Line(L.GRAPHS, r.graphs, note="at most; their recordings' pool in the headroom"),) if r.graphs else ()),
             L.Line(L.HEADROOM, r.headroom))
    return L.Line(L.RESERVE, r.total, parts, note)


def _smaller_kv_dtypes(kv_dtype: str) -> list[str]:
    """The KV dtypes that store less than kv_dtype, largest first (int8, k8v4, q4)."""
    order = ["int8", "k8v4", "q4"]
    return order[order.index(kv_dtype) + 1:] if kv_dtype in order else order[:1]


def _serve_check(fp, cfg, snap, reserve, budget, available, slots, min_slots, kv_dtype):
    if available < 0:
        why = (f"the dense weights, sequence state and reserve need {L.mib(-available):.0f} MiB more than the card "
               f"has free ({L.mib(snap.free_bytes):.0f} MiB)")
        return "REFUSED", why, refusal_fixes(fp, cfg, snap, reserve, min_slots, kv_dtype, available)
    if available < budget and cfg.expert_cache != "auto":
        why = (f"--expert-cache {cfg.expert_cache} needs {L.mib(budget):.0f} MiB but only "
               f"{L.mib(max(0, available)):.0f} MiB is left after the other lines")
        return "REFUSED", why, refusal_fixes(fp, cfg, snap, reserve, min_slots, kv_dtype, available)
    if slots < min_slots:
        why = (f"the expert cache gets {slots} experts, below the minimum of {min_slots} "
               f"({L.mib(max(0, available)):.0f} MiB left for it)")
        return "REFUSED", why, refusal_fixes(fp, cfg, snap, reserve, min_slots, kv_dtype, available)
    low = cfg.low_headroom_mib * MIB
    if reserve.headroom < low:
        ok_at = _round_mib(reserve.total + low - reserve.headroom)
        return "LOW", (f"reserve headroom {L.mib(reserve.headroom):.0f} MiB is below {cfg.low_headroom_mib} MiB; "
                       f"a reserve of {L.mib(ok_at):.0f} MiB makes it OK"), []
    return "OK", f"reserve headroom {L.mib(reserve.headroom):.0f} MiB", []


def refusal_fixes(fp, cfg, snap, reserve, min_slots, kv_dtype, available) -> list[str]:
    """Concrete ways to fit, with numbers."""
    need = slots_bytes(min_slots if cfg.expert_cache == "auto" else int(cfg.expert_cache), fp.largest_blob)
    short = need - available
    fixes = [f"close pid {p.pid} ({p.name}) holding {L.mib(p.bytes):.0f} MiB"
             for p in sorted(snap.processes, key=lambda p: -p.bytes)[:3] if p.bytes >= short]
    kv_tok = fp.kv_bytes_per_token(kv_dtype) * cfg.sessions
    ctx_fit = cfg.ctx - -(-short // kv_tok) if kv_tok else 0
    if ctx_fit >= 256:
        fixes.append(f"--ctx {int(ctx_fit) // 256 * 256} fits")
    for smaller in _smaller_kv_dtypes(kv_dtype):
        saved = (fp.state_bytes(cfg.ctx, kv_dtype, cfg.prefill_chunk)
                 - fp.state_bytes(cfg.ctx, smaller, cfg.prefill_chunk)) * cfg.sessions
        fixes.append(f"--kv-dtype {smaller} saves {L.mib(saved):.0f} MiB" + (" (enough)" if saved >= short else ""))
    if reserve.total - short >= reserve.prompt:
        fixes.append(f"--vram-reserve-mib {int(L.mib(reserve.total - short))} fits (the serve check may say LOW)")
    if cfg.kv_resident != "auto":
        fixes.append("--kv-resident auto streams the older KV to host memory when the context does not fit")
    if cfg.expert_cache != "auto" and available > 0 and fp.largest_blob:
        fixes.append(f"--expert-cache {slots_fitting(available, fp.largest_blob)} fits (or --expert-cache auto)")
    return fixes

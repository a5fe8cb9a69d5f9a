"""The engine's state as the JSON contract names it (generate --json, /v1/status)."""

from __future__ import annotations

from moefit.errors import DeviceUnavailable
from moefit.kernels import gemm
from moefit.memory import ledger as L
from moefit.memory.planner import device_json


def cache_json(engine) -> dict:
    book = engine.runner.book
    plan = engine.loaded.plan
    hits, misses = int(book.hits.sum()), int(book.misses.sum())
    return {
        "slots": len(engine.runner.slots), "budget_bytes": book.budget, "used_bytes": book.used,
        "largest_blob_bytes": plan.largest_blob if plan else max(book.sizes.values()),
        "min_slots": plan.min_slots if plan else 0, "total_experts": len(book.sizes),
        "planned_slots": plan.slots if plan else 0,
        "hits": hits, "misses": misses, "hit_rate": book.hit_rate(),
        "layer_hit_rates": book.layer_hit_rates(), "swaps": book.swaps, "bytes_moved": book.bytes_moved,
        "pool_bytes": engine.runner.pool.allocated, "pool_chunks": len(engine.runner.pool.chunks),
        "pcie_loads": engine.runner.pcie_loads, **engine.runner.costs.to_json(),
        "expert_gemm_rows": engine.runner.rates.reported(), "host_panels": engine.runner.panels.report(),
        "handoffs_per_token": engine.runner.handoffs / engine.runner.tokens if engine.runner.tokens else 0.0,
        "handoffs_per_moe_layer_token": (engine.runner.handoffs / engine.runner.tokens / len(engine.pack.model.moe_layers)
                                         if engine.runner.tokens else 0.0),
        **(engine.runner.ahead.to_json() if engine.runner.ahead else
           {"prefetched": 0, "prefetch_hits": 0, "prefetch_late": 0, "prediction_recall": None, "layer_prediction_recall": [],
            "prefetch_per_layer": 0, "predictor": None}),
    }


def speculative_json(engine) -> dict:
    st, window = engine.spec_stats, engine.window
    recent = window.history[-64:]
    mean = lambda key: sum(w[key] for w in recent) / len(recent) if recent else 0.0  # noqa: E731
    return {"enabled": engine.spec_mode != "off", "mode": engine.spec_mode, "reason": engine.spec_reason,
            "accepted": st.accepted, "drafted": st.drafted, "windows": st.windows,
            "acceptance_rate": st.acceptance, "accepted_per_window": st.accepted / st.windows if st.windows else 0.0,
            "window_now": window.k if not window.off_for else 0, "speedup_estimate": window.speedup(),
            "distinct_experts_per_window": mean("distinct_experts"), "misses_per_window": mean("misses")}


def sessions_json(engine) -> list[dict]:
    """Each session (--sessions): the tokens whose state it holds, and whether the last request ran on it."""
    return [{"tokens": len(s.tokens), "last_request": s.used, "current": s is engine.session}
            for s in engine.sessions]


def status_json(engine) -> dict:
    """Ledger, cache statistics, serve check, speculative state and the device now."""
    plan = engine.loaded.plan
    out = plan.to_json() if plan else {"device": {"name": "cpu (host memory, no VRAM)", "total_bytes": 0,
                                                  "free_bytes": 0, "processes": []}, "ledger": []}
    out["expert_cache"] = cache_json(engine)
    out["charged"] = {k: v for k, v in engine.loaded.mem.charged.items() if v}
    if plan:
        try:
            out["device_now"] = device_json(engine.loaded.mem.snapshot())
        except DeviceUnavailable as e:
            out["device_now"] = {"error": str(e)}
    out["speculative"] = speculative_json(engine)
    out["decode_graphs"] = engine.decode_graphs_json()
    out["sessions"] = sessions_json(engine)
    out["compute_dtype"] = engine.loaded.compute_dtype
    out["prompt_product_ways"] = gemm.chosen()
    out["notes"] = engine.loaded.notes
    return out


def summary_line(engine) -> str:
    s = engine.last
    book = engine.runner.book
    return (f"prompt {s.prompt_tokens} tok ({s.cached_tokens} reused) at {s.prefill_tokens_per_s:.1f} tok/s, "
            f"{len(s.generated)} generated at {s.decode_tokens_per_s:.1f} tok/s; expert cache "
            f"{len(engine.runner.slots)} experts / {L.mib(book.used):.1f} MiB, hit rate {100 * book.hit_rate():.1f}%")

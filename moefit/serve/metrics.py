"""Prometheus text for /metrics: vLLM's names where one exists, moefit_ names for the rest."""

from __future__ import annotations

import threading
from collections import Counter

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Histogram:
    def __init__(self, buckets):
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.total = 0.0
        self.n = 0

    def observe(self, v: float) -> None:
        self.total += v
        self.n += 1
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1

    def lines(self, name: str) -> list[str]:
        out = [f"# TYPE {name} histogram"]
        out += [f'{name}_bucket{{le="{b}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        return out + [f'{name}_bucket{{le="+Inf"}} {self.n}', f"{name}_sum {self.total}", f"{name}_count {self.n}"]


class Metrics:
    def __init__(self):
        self._lock = threading.Lock()
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.generation_tokens = 0
        self.requests = Counter()
        self.http_requests = Counter()         # (route, status) of every request, whatever became of it
        self.ttft = Histogram(TTFT_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)

    def finished(self, stats, status: int, seconds: float) -> None:
        with self._lock:
            self.requests[status] += 1
            self.e2e.observe(seconds)
            if stats is not None:
                self.prompt_tokens += stats.prompt_tokens
                self.cached_tokens += stats.cached_tokens
                self.generation_tokens += len(stats.generated)
                self.ttft.observe(stats.first_token_s)

    def rejected(self, status: int) -> None:
        with self._lock:
            self.requests[status] += 1

    def http(self, path: str, status: int) -> None:
        route = path if path.startswith("/v1/") or path in ("/health", "/metrics", "/props") else "other"
        with self._lock:
            self.http_requests[(route, status)] += 1

    def render(self, engine, worker, guard, device_free: int | None) -> str:
        book = engine.cache
        gauge = lambda n, v, t="gauge": [f"# TYPE {n} {t}", f"{n} {v}"]  # noqa: E731
        with self._lock:
            lines = gauge("vllm:num_requests_running", len(worker.running))
            lines += gauge("vllm:num_requests_waiting", len(worker.waiting))
            lines += gauge("vllm:prompt_tokens_total", self.prompt_tokens, "counter")
            lines += gauge("vllm:generation_tokens_total", self.generation_tokens, "counter")
            lines += gauge("vllm:prefix_cache_hits_total", self.cached_tokens, "counter")
            lines += self.ttft.lines("vllm:time_to_first_token_seconds")
            lines += self.e2e.lines("vllm:e2e_request_latency_seconds")
            held = sum(len(s.tokens) for s in engine.sessions)
            lines += gauge("vllm:kv_cache_usage_perc", round(held / engine.cfg.ctx / len(engine.sessions), 6))
            lines += ["# TYPE moefit_requests_total counter"]
            lines += [f'moefit_requests_total{{status="{s}"}} {n}' for s, n in sorted(self.requests.items())]
            lines += ["# TYPE moefit_http_requests_total counter"]
            lines += [f'moefit_http_requests_total{{route="{r}",status="{s}"}} {n}'
                      for (r, s), n in sorted(self.http_requests.items())]
        lines += gauge("vllm:spec_decode_num_drafts_total", engine.spec_stats.windows, "counter")
        lines += gauge("vllm:spec_decode_num_draft_tokens_total", engine.spec_stats.drafted, "counter")
        lines += gauge("vllm:spec_decode_num_accepted_tokens_total", engine.spec_stats.accepted, "counter")
        lines += gauge("moefit_expert_cache_slots", engine.cached_experts())
        lines += gauge("moefit_expert_cache_bytes", book.used)
        lines += gauge("moefit_expert_cache_budget_bytes", book.budget)
        lines += gauge("moefit_expert_cache_hits_total", int(book.hits.sum()), "counter")
        lines += gauge("moefit_expert_cache_misses_total", int(book.misses.sum()), "counter")
        lines += gauge("moefit_expert_cache_swaps_total", book.swaps, "counter")
        lines += gauge("moefit_expert_cache_bytes_moved_total", book.bytes_moved, "counter")
        lines += gauge("moefit_guard_warnings_total", guard.warnings, "counter")
        lines += gauge("moefit_cache_resizes_total", guard.resizes, "counter")
        if device_free is not None:
            lines += gauge("moefit_device_free_bytes", device_free)
        return "\n".join(lines) + "\n"

"""Speculative decoding: where drafts come from, the acceptance rule, and the MoE-aware
window that decides how many drafts a step verifies (down to none).

Verification itself is one forward of [last token, d1..dk] over the static KV cache
(decoding.verify): rejected positions are simply overwritten by later writes. A draft is
kept when the sampler draws it itself at that position (see decoding.py), which keeps
the output exactly what plain decoding gives, greedy or seeded.
"""

from __future__ import annotations

from dataclasses import dataclass, field



class NgramIndex:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the
    context's last n tokens (n = max_n down to min_n). No weights."""

    def __init__(self, max_n: int = 3, min_n: int = 1):
        self.max_n, self.min_n = max_n, min_n
        self.tokens: list[int] = []
        self.last: dict[tuple, int] = {}          # n-gram -> position just after its latest occurrence

    def extend(self, tokens: list[int]) -> None:
        """Make the index cover `tokens` (a context that only grows, or a new one). An
        n-gram is recorded once the token after it is known."""
        if tokens[:len(self.tokens)] != self.tokens:
            self.tokens, self.last = [], {}
        for i in range(len(self.tokens), len(tokens)):
            self.tokens.append(tokens[i])
            for n in range(self.min_n, self.max_n + 1):
                if i - n >= 0:
                    self.last[tuple(tokens[i - n:i])] = i

    def draft(self, context: list[int], k: int) -> list[int]:
        self.extend(context)                       # the suffix itself is not indexed yet: earlier hits only
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(context) < n:
                continue
            at = self.last.get(tuple(context[-n:]))
            if at is not None and at < len(context):
                return context[at:at + k]
        return []


@dataclass
class Window:
    """How many drafts to verify next. Verifying k drafts routes to more distinct experts
    than one token (more misses on the host), so a window must pay for itself: the measured
    tokens per second of windows are compared with plain decode steps, and k moves down
    (to off, for a cool-down) when they do not, up when acceptance is high."""

    k_max: int
    k: int = 0
    cooldown: int = 32
    off_for: int = 0
    zero_streak: int = 0
    window_s: float = 0.0          # EMA seconds per window
    window_tokens: float = 0.0     # EMA tokens produced per window (accepted + 1)
    step_s: float = 0.0            # EMA seconds per plain decode step
    since_plain: int = 0           # windows since the last plain step (the cost baseline is re-measured)
    probe_every: int = 16
    history: list[dict] = field(default_factory=list)

    def __post_init__(self):
        self.k = self.k or self.k_max

    def size(self) -> int:
        if not self.step_s or self.since_plain >= self.probe_every:
            return 0                                # a plain step: what a window is compared with
        if self.off_for > 0:
            self.off_for -= 1
            if self.off_for == 0:
                self.k = 1                          # probe again, small
            return 0
        return self.k

    def record_plain(self, seconds: float) -> None:
        self.step_s = seconds if not self.step_s else 0.8 * self.step_s + 0.2 * seconds
        self.since_plain = 0

    def record(self, k: int, accepted: int, seconds: float, distinct_experts: int, misses: int) -> None:
        self.since_plain += 1
        self.window_s = seconds if not self.window_s else 0.7 * self.window_s + 0.3 * seconds
        tokens = accepted + 1
        self.window_tokens = tokens if not self.window_tokens else 0.7 * self.window_tokens + 0.3 * tokens
        self.history.append({"k": k, "accepted": accepted, "seconds": seconds,
                             "distinct_experts": distinct_experts, "misses": misses})
        del self.history[:-256]
        self.zero_streak = self.zero_streak + 1 if accepted == 0 else 0
        if self.zero_streak >= 4 or (self.step_s and self.speedup() < 0.9):
            self._down()
        elif accepted == k and k < self.k_max and (not self.step_s or self.speedup() > 1.1):
            self.k += 1

    def speedup(self) -> float:
        """Tokens per second of windows over tokens per second of plain steps."""
        if not (self.step_s and self.window_s):
            return 1.0
        return (self.window_tokens / self.window_s) * self.step_s

    def _down(self) -> None:
        self.zero_streak = 0
        self.k -= 1
        if self.k <= 0:
            self.k, self.off_for = 0, self.cooldown

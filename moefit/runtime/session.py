"""A Session: one conversation's decoding state, what the decode loop (runtime/decoding.py)
works on with the model.

    session.tokens       the tokens whose sequence state is held (positions 0..n-1)
    session.state        that sequence state, per layer (runtime/state.py)
    session.window       the speculative window, adapting to what it measures
    session.spec_stats   windows verified, tokens drafted and accepted
    session.last         the last request's figures (prompt, cached, generated, timings)
    session.hidden       the final hidden states of the last forward (draft heads read them)
    session.ends         the last prompts' ends -> their last token's final hidden state and logits,
                         in host memory (a chat's next turn resumes there: an MTP row's input; the
                         same prompt again, a regenerated reply, runs nothing: runtime/engine.py)

The engine holds --sessions of them, each with its own sequence state (planned and charged on
the card): a request goes to the session whose tokens it reuses best, or to the least recently
used one (session_for), and reuses that session's longest common prefix with its prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moefit.families.state import PROMPT_MARKS
from moefit.runtime.speculative import Window


@dataclass
class SpecStats:
    """Speculative decoding counters: windows verified, tokens drafted and accepted."""

    windows: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def record(self, drafted: int, accepted: int) -> None:
        self.windows += 1
        self.drafted += drafted
        self.accepted += accepted


@dataclass
class RequestStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated: list[int] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    first_token_s: float = 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return (self.prompt_tokens - self.cached_tokens) / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        n = len(self.generated) - 1                 # the first token comes from the prefill
        return n / self.decode_s if n > 0 and self.decode_s else 0.0


@dataclass
class PromptEnd:
    hidden: torch.Tensor            # [E] the final hidden state of the prompt's last token (host memory)
    logits: torch.Tensor            # [V] its logits (host memory)


@dataclass
class Session:
    state: object                                   # runtime.state.SequenceState
    window: Window
    tokens: list[int] = field(default_factory=list)
    spec_stats: SpecStats = field(default_factory=SpecStats)
    last: RequestStats = field(default_factory=RequestStats)
    hidden: torch.Tensor | None = None              # [T, E] of the last forward
    last_hidden: torch.Tensor | None = None         # [E] of its last position
    ends: dict[int, PromptEnd] = field(default_factory=dict)
    mtp: object | None = None                       # its MTP drafter (runtime/mtp.py), with the MTP's own KV
    used: int = 0                                   # when a request last ran on it (the engine's count)

    def mark_end(self, pos: int, hidden: torch.Tensor, logits: torch.Tensor) -> None:
        """A prompt of `pos` tokens was consumed: its state is kept (recurrent layers' marks) and
        its last token's hidden state and logits, for as many prompts as the marks."""
        self.state.mark()
        self.ends[pos] = PromptEnd(hidden.detach().to("cpu", copy=True), logits.detach().to("cpu", copy=True))
        while len(self.ends) > PROMPT_MARKS:
            del self.ends[next(iter(self.ends))]


    def end_at(self, pos: int) -> PromptEnd | None:
        """The kept end of a prompt of `pos` tokens, where every layer can resume at it; else None."""
        end = self.ends.get(pos)
        return end if end is not None and self.state.resumable(pos) == pos else None


def session_for(sessions: list[Session], prompt: list[int]) -> Session:
    """The session a prompt runs on: the one where the tokens it reuses outweigh the held tokens
    it overwrites by the most (an empty session: 0), the least recently used on a tie. A chat's
    next turn continues its own session; a side request that shares a system prompt or a few
    tokens with a long conversation (an agent's title call, a sub-agent) takes an empty or a
    short session and leaves that conversation's state for its next turn."""
    def gain(s: Session) -> tuple[int, int]:
        reuse = reusable(s, prompt)
        return reuse - (len(s.tokens) - reuse), -s.used
    return max(sessions, key=gain)


def reusable(session: Session, prompt: list[int]) -> int:
    """The prompt tokens whose state the session holds and every layer can resume after."""
    return session.state.resumable(min(common_prefix(session.tokens, prompt), len(prompt) - 1))


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i

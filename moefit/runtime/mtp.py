"""The checkpoint's MTP layer as a draft source (--spec mtp; models/mtp.py computes it).

Its KV row at position i is made from (h_i, the token at i + 1), so it can be written only once
that token is known. The drafter keeps the model's hidden states from every forward (`observe`)
until then, and writes the rows whose next token is known in one MTP forward (`catch_up`): a
prompt's after each chunk, decode steps' and verify windows' when drafting next needs them (or
when many are held).

Drafting after the model has run positions 0..m-1 and sampled token t_m: the catch-up's last row
is (h_{m-1}, t_m), whose logits give draft 1; each further draft runs the MTP layer on its own
output and the previous draft (rows m, m+1, ... of its KV, rewritten from the model's hidden
states once the verify window has said which drafts stand). Drafts are the MTP's argmax; the
verify step keeps only what the sampler draws itself, so the output does not depend on them.

The layer's weights and its KV over the context are the reserve's draft line (planner); its
experts run on the host from the pack's map (experts/runner.run_on_host), outside the cache.
Only the first MTP layer drafts (every checkpoint published so far has one).
"""

from __future__ import annotations

import torch

from moefit.memory import ledger as L
from moefit.memory.footprint import mtp_dense_names
from moefit.models.layers import Weights
from moefit.models.mtp import mtp_forward, mtp_logits
from moefit.pack.quant import TORCH_DTYPES
from moefit.runtime.state import SequenceState

PENDING_MAX = 64          # decode steps' hidden rows held before they are written anyway


class MtpDrafter:
    def __init__(self, model, mtp: dict, state: SequenceState, runner, chunk: int):
        self.model, self.mtp, self.state, self.chunk = model, mtp, state, chunk
        self.done = 0                               # positions whose KV row is final
        self.pending: torch.Tensor | None = None    # the model's hidden states at positions done..
        self.experts = _HostExperts(runner)

    def observe(self, start: int, h: torch.Tensor) -> None:
        """The model ran positions start..start+T and gave h [T, E]. Held rows from `start` on are
        stale (a rejected draft's, another prompt's) and dropped."""
        held = 0 if self.pending is None else self.pending.shape[0]
        if start < self.done or start > self.done + held:    # back before the written rows, or a gap
            self.done, held = start, 0
        kept = self.pending[:start - self.done] if held else h[:0]
        self.pending = torch.cat((kept, h.detach()))

    def settle(self, tokens: list[int]) -> None:
        """Between drafts (the window off, plain decode steps): write the held rows once there are many."""
        if self.pending is not None and self.pending.shape[0] > PENDING_MAX:
            self.catch_up(tokens)

    def catch_up(self, tokens: list[int]) -> torch.Tensor | None:
        """Write the rows whose next token `tokens` holds; the hidden the last one passed on, or None."""
        n = 0 if self.pending is None else min(self.pending.shape[0], len(tokens) - 1 - self.done)
        out = None
        for at in range(0, n, self.chunk):
            rows = self.pending[at:min(n, at + self.chunk)]
            start = self.done + at
            nxt = torch.tensor(tokens[start + 1:start + 1 + rows.shape[0]], dtype=torch.long)
            out = mtp_forward(self.model, self.mtp, rows, nxt, start, self.state, self.experts)[-1:]
        if n:
            self.done += n
            self.pending = self.pending[n:]
        return out

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """k drafts after tokens (the sequence with the token just sampled last)."""
        hidden = self.catch_up(tokens)
        if hidden is None or self.done != len(tokens) - 1:
            return []
        drafts = [self._best(hidden)]
        for pos in range(len(tokens) - 1, len(tokens) - 2 + k):      # rows m, m+1, ...: (its hidden, a draft)
            hidden = mtp_forward(self.model, self.mtp, hidden, torch.tensor(drafts[-1:]), pos, self.state,
                                 self.experts)
            drafts.append(self._best(hidden))
        return drafts

    def _best(self, hidden: torch.Tensor) -> int:
        return int(mtp_logits(self.model, self.mtp, hidden)[-1].argmax())


class _HostExperts:
    """The MoE's view of the MTP layer's experts: every one on the host."""

    look_ahead = False

    def __init__(self, runner):
        self.run = runner.run_on_host

    def run_routed(self, *args) -> None:
        return None                            # routed by the family, then run_on_host


def load_mtp(pack, loaded, cfg, kv_dtype: str) -> list[MtpDrafter]:
    """The pack's first MTP layer on the device, and a drafter with its own KV for each session,
    all charged to the reserve."""
    m, mem = pack.model, loaded.mem
    dtype = TORCH_DTYPES[loaded.compute_dtype]
    place = lambda name, t, keep=False: mem.copy_in(  # noqa: E731
        L.RESERVE, t, dtype if t.is_floating_point() and not keep else None)
    weights = Weights(mtp_dense_names(m, pack.dense_names), pack.dense, place, cfg.dense_quant)
    mtp = loaded.model.mtp_layer(weights, 0) | {"index": m.num_layers, "style": m.mtp_style}
    resident = loaded.kv.resident                    # under KV streaming, the model's window and a host part
    state = lambda: SequenceState(m, cfg.ctx, kv_dtype, dtype, mem, cfg.prefill_chunk, resident,  # noqa: E731
                                  decls=[m.spec.mtp_state(m)], line=L.RESERVE)
    return [MtpDrafter(loaded.model, mtp, state(), loaded.runner, cfg.prefill_chunk) for _ in loaded.states]

"""The decode loop, on the engine's session (runtime/session.py) and its model: one token per
step, or a speculative window (last token + k drafts verified in one forward) when a draft
source has something and the window pays.

Output is the same with or without speculation, greedy or seeded: a draft is kept only
when it is the token the sampler itself draws at that position from the target's logits
(argmax, or the position's own uniform). That is lossless for any draft source.
"""

from __future__ import annotations

import time
from typing import Iterator

import torch

from moefit.runtime.sampler import Sampler
from moefit.runtime.speculative import NgramIndex


CHUNK_DONE = object()      # between two of a prompt's prefill forwards: another session's step may run here


def token_stream(engine, prompt: list[int], sampler: Sampler, budget: int) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield (token, the logits [V] it was drawn from), CHUNK_DONE between a long prompt's prefill
    chunks; at most `budget` tokens. The caller stops early by closing it."""
    session = engine.session
    logits, session.last.cached_tokens = yield from engine.prefill_steps(prompt)
    token = _take(sampler, sampler.probs(logits))
    yield token, logits
    produced, pos = 1, len(prompt)
    lookup = NgramIndex() if engine.spec_mode == "lookup" else None
    while produced < budget:
        room = min(budget - produced, engine.cfg.ctx - pos) - 1
        k = min(session.window.size(), room) if engine.spec_mode != "off" else 0
        drafts = _drafts(engine, lookup, token, k)
        if drafts:
            new = verify(engine, token, pos, drafts, sampler)
        else:
            t0 = time.perf_counter()
            logits = engine.decode_step(token, pos)
            new = [(_take(sampler, sampler.probs(logits)), logits)]
            session.window.record_plain(time.perf_counter() - t0)
        yield from new
        produced, pos, token = produced + len(new), pos + len(new), new[-1][0]


def _take(sampler: Sampler, probs: torch.Tensor) -> int:
    token = sampler.draw(probs)
    sampler.accept(token)
    return token


def _drafts(engine, lookup, token, k) -> list[int]:
    if k <= 0:
        return []
    if lookup is not None:
        return lookup.draft(engine.session.tokens + [token], k)
    if engine.mtp is not None:
        return engine.mtp.propose(engine.session.tokens + [token], k)
    return engine.draft_head.propose(engine, token, k)


def verify(engine, token: int, pos: int, drafts: list[int], sampler: Sampler) -> list[tuple[int, torch.Tensor]]:
    """Run [token, d1..dk] at pos..pos+k in one forward; keep the drafts the target agrees
    with, then one token of its own (the correction, or a bonus when all were kept).
    Returns (token, its logits) pairs."""
    book = engine.runner.book
    hits0, misses0 = int(book.hits.sum()), int(book.misses.sum())
    t0 = time.perf_counter()
    engine.session.state.checkpoint(True)                 # recurrent layers keep the state after each position
    try:
        logits = engine.forward([token] + drafts, pos)                       # [k+1, V]
    finally:
        engine.session.state.checkpoint(False)
    out = []
    for i, d in enumerate(drafts):
        t = _take(sampler, sampler.probs(logits[i]))
        out.append((t, logits[i]))
        if t != d:
            break
    else:
        out.append((_take(sampler, sampler.probs(logits[len(drafts)])), logits[len(drafts)]))
    accepted = len(out) - 1
    if engine.session.state.recurrent:                    # back to the kept tokens; the checkpoints freed
        engine.keep(pos, [token] + drafts[:accepted])      # recurrent layers: back to pos, kept tokens again
    session = engine.session
    session.last_hidden = session.hidden[accepted]
    session.tokens = session.tokens[:pos] + [token] + drafts[:accepted]
    distinct = int(book.hits.sum()) + int(book.misses.sum()) - hits0 - misses0
    session.spec_stats.record(len(drafts), accepted)
    session.window.record(len(drafts), accepted, time.perf_counter() - t0, distinct,
                         int(book.misses.sum()) - misses0)
    return out

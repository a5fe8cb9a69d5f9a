"""The decode loop: one token per step, or a speculative window (last token + k drafts
verified in one forward) when a draft source has something and the window pays.

Greedy output is the same with or without speculation: a draft is kept only when it is
the token greedy decoding would have picked from the same logits.
"""

from __future__ import annotations

import time
from typing import Iterator

import torch

from moefit.runtime.sampler import Sampler
from moefit.runtime.speculative import NgramIndex, accept_or_resample


def token_stream(engine, prompt: list[int], sampler: Sampler, budget: int) -> Iterator[int]:
    """Yield generated tokens; at most `budget`. The caller stops early by closing it."""
    logits, engine.last.cached_tokens = engine.prefill(prompt)
    token = _take(sampler, sampler.probs(logits))
    yield token
    produced, pos = 1, len(prompt)
    lookup = NgramIndex() if engine.spec_mode == "lookup" else None
    while produced < budget:
        room = min(budget - produced, engine.cfg.ctx - pos) - 1
        k = min(engine.window.size(), room) if engine.spec_mode != "off" else 0
        drafts, q = _drafts(engine, lookup, prompt, token, k)
        if drafts:
            new = verify(engine, token, pos, drafts, q, sampler)
        else:
            t0 = time.perf_counter()
            logits = engine.decode_step(token, pos)
            new = [_take(sampler, sampler.probs(logits))]
            engine.window.record_plain(time.perf_counter() - t0)
        for t in new:
            yield t
        produced, pos, token = produced + len(new), pos + len(new), new[-1]


def _take(sampler: Sampler, probs: torch.Tensor) -> int:
    token = sampler.draw(probs)
    sampler.accept(token)
    return token


def _drafts(engine, lookup, prompt, token, k) -> tuple[list[int], torch.Tensor | None]:
    if k <= 0:
        return [], None
    if lookup is not None:
        return lookup.draft(engine.kv_tokens + [token], k), None
    return engine.draft_head.propose(engine, token, k)


def verify(engine, token: int, pos: int, drafts: list[int], q, sampler: Sampler) -> list[int]:
    """Run [token, d1..dk] at pos..pos+k in one forward; keep the drafts the target agrees
    with, then one token of its own (the correction, or a bonus when all were kept)."""
    book = engine.runner.book
    hits0, misses0 = int(book.hits.sum()), int(book.misses.sum())
    t0 = time.perf_counter()
    logits = engine.forward([token] + drafts, pos)                           # [k+1, V]
    out = []
    for i, d in enumerate(drafts):
        p = sampler.probs(logits[i])
        if sampler.p.greedy:
            t, ok = int(p.argmax()), int(p.argmax()) == d
        else:
            u = float(torch.rand((), generator=sampler.generator))
            t, ok = accept_or_resample(p, d, None if q is None else q[i], u, sampler.generator)
        sampler.accept(t)
        out.append(t)
        if not ok:
            break
    else:
        out.append(_take(sampler, sampler.probs(logits[len(drafts)])))
    accepted = len(out) - 1
    engine.last_hidden = engine.hidden[accepted]
    engine.kv_tokens = engine.kv_tokens[:pos] + [token] + drafts[:accepted]
    distinct = int(book.hits.sum()) + int(book.misses.sum()) - hits0 - misses0
    engine.spec_stats.record(len(drafts), accepted)
    engine.window.record(len(drafts), accepted, time.perf_counter() - t0, distinct,
                         int(book.misses.sum()) - misses0)
    return out

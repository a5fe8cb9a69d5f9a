"""Sampling: penalties, logit bias, temperature, top-k, top-p, min-p, seeded draws; greedy at T=0.

Penalties follow their usual definitions: repetition (CTRL, over prompt and output),
presence and frequency (OpenAI, over the output only).

A seeded draw depends only on (seed, position in the output): the n-th token takes the
n-th uniform of the seed's stream, by inverse CDF. So one seed gives one text, whether
tokens come one per step or several per speculative window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None           # None: none; N: the chosen token's and the top N
    grammar: str | None = None            # an llguidance grammar the output must follow (runtime/grammar.py)
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias added to its logit before the draw)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def check(self) -> None:
        """ValueError naming the field when a value is out of range."""
        rules = [("temperature", 0 <= self.temperature <= 10), ("top_p", 0 < self.top_p <= 1),
                 ("top_k", self.top_k >= 0), ("min_p", 0 <= self.min_p <= 1),
                 ("repetition_penalty", 0 < self.repetition_penalty <= 10),
                 ("presence_penalty", -2 <= self.presence_penalty <= 2),
                 ("frequency_penalty", -2 <= self.frequency_penalty <= 2), ("max_tokens", self.max_tokens >= 1),
                 ("logit_bias", all(t >= 0 and -100 <= b <= 100 for t, b in self.logit_bias))]
        for name, ok in rules:
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)} is out of range")


class Sampler:
    """Usage: s = Sampler(params, prompt_ids); tok = s.next(logits); s.accept(tok)"""

    def __init__(self, params: SamplingParams, prompt_ids: list[int], vocab_size: int, constraint=None):
        self.p = params
        self.constraint = constraint            # a grammar.Constraint, or None
        self.seed = (params.seed if params.seed is not None else torch.seed()) % (1 << 64)
        self.index = 0                               # tokens accepted so far: which uniform is next
        self.seen = torch.zeros(vocab_size, dtype=torch.bool)
        self.seen[torch.tensor(prompt_ids, dtype=torch.long)] = True
        self.counts = torch.zeros(vocab_size, dtype=torch.float32)
        self._top, self._one_hot = -1, None          # greedy: the last probs() made and its token
        biased = params.logit_bias
        self.bias_ids = torch.tensor([t for t, _ in biased], dtype=torch.long)
        self.bias = torch.tensor([b for _, b in biased], dtype=torch.float32)

    def accept(self, token: int) -> None:
        if self.constraint is not None:
            self.constraint.accept(token)
        self.index += 1
        self.seen[token] = True
        self.counts[token] += 1

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution the next token is drawn from, [V] (one-hot when greedy), on the
        logits' device: only the drawn token id comes back to the host (and the grammar's mask,
        which is built on the host, takes the logits there)."""
        logits = logits.float()
        if self.constraint is not None:                 # the grammar first: forbidden tokens never come back
            logits = self.constraint.mask(logits.cpu())
        if self.seen.device != logits.device:
            self.seen, self.counts = self.seen.to(logits.device), self.counts.to(logits.device)
            self.bias_ids, self.bias = self.bias_ids.to(logits.device), self.bias.to(logits.device)
        logits = self._penalised(logits)
        if len(self.bias):                               # logit_bias (OpenAI's): after the penalties, before the rest
            logits = logits.index_add(0, self.bias_ids, self.bias)
        if self.p.greedy:
            self._top = int(logits.argmax())             # draw reads it back (an argmax of 151,936 is ~0.15 ms)
            self._one_hot = torch.zeros(logits.shape[-1], device=logits.device)
            self._one_hot[self._top] = 1.0
            return self._one_hot
        logits = logits / self.p.temperature
        if self.p.top_k > 0:
            kth = torch.topk(logits, min(self.p.top_k, logits.shape[-1])).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if self.p.top_p < 1.0:
            probs = _top_p(probs, self.p.top_p)
        if self.p.min_p > 0.0:
            probs = probs.masked_fill(probs < self.p.min_p * probs.max(), 0.0)
        return probs / probs.sum()

    def draw(self, probs: torch.Tensor) -> int:
        """The token at this output position: argmax when greedy, else inverse CDF at the
        position's uniform (a token of probability 0 is never drawn)."""
        if self.p.greedy:
            return self._top if probs is self._one_hot else int(probs.argmax())
        cdf = torch.cumsum(probs.double(), dim=0)
        token = int(torch.searchsorted(cdf, uniform(self.seed, self.index) * float(cdf[-1]), right=True))
        return token if token < len(probs) else int(torch.nonzero(probs)[-1])

    def next(self, logits: torch.Tensor) -> int:
        return self.draw(self.probs(logits))

    def _penalised(self, logits: torch.Tensor) -> torch.Tensor:
        if self.p.repetition_penalty != 1.0:
            pen = torch.where(logits > 0, logits / self.p.repetition_penalty, logits * self.p.repetition_penalty)
            logits = torch.where(self.seen, pen, logits)
        if self.p.presence_penalty or self.p.frequency_penalty:
            logits = logits - self.p.presence_penalty * (self.counts > 0) - self.p.frequency_penalty * self.counts
        return logits


MASK64 = 0xFFFFFFFFFFFFFFFF


def mix64(z: int) -> int:
    """SplitMix64's output function (Steele et al. 2014): a 64-bit integer -> a well-mixed one."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def uniform(seed: int, index: int) -> float:
    """The index-th number in [0, 1) of seed's stream (SplitMix64)."""
    return (mix64((seed + (index + 1) * 0x9E3779B97F4A7C15) & MASK64) >> 11) / float(1 << 53)


def choice_seed(seed: int | None, choice: int) -> int | None:
    """The seed of a request's choice `choice` (its n > 1): choice 0 keeps the request's, so the
    first of n choices is the text n=1 gives; the others' streams are mixed from it (a stream of
    seed + k would be the first's, shifted). No seed: each choice draws its own."""
    if seed is None or choice == 0:
        return seed
    return mix64((seed ^ (choice * 0xD1B54A32D192ED03)) & MASK64)


NUCLEUS_FLOORS = (1e-2, 1e-4, 1e-6)    # candidate floors for _top_p, as fractions of the largest probability


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """probs with only the nucleus kept: the most probable tokens, in order, while the mass before
    each is under top_p (the first always). Only the tokens at or above a floor are sorted, the
    first floor whose tokens hold more than top_p (they are then the head of the whole order, ties
    included, and the nucleus ends inside them): the same tokens and values as sorting the whole
    vocabulary, which took 13 ms a token at 151,936 words here (a model's peaked distribution: ~0.3)."""
    top = float(probs.max())
    for floor in NUCLEUS_FLOORS:
        head = torch.nonzero(probs >= top * floor).squeeze(1)
        if 4 * head.numel() > probs.numel():                 # a flat distribution: sort it all
            break
        if float(probs[head].sum()) >= top_p + 1e-4:        # a margin over the sum's rounding
            return _nucleus(probs, head, top_p)
    return _nucleus(probs, None, top_p)


def _nucleus(probs: torch.Tensor, head: torch.Tensor | None, top_p: float) -> torch.Tensor:
    """The nucleus of probs among the tokens `head` (None: all), sorted as the whole would be: tied
    tokens in vocabulary order (`head` is ascending), so that a nucleus cut inside a tie is one set."""
    sorted_p, order = torch.sort(probs if head is None else probs[head], descending=True, stable=True)
    keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < top_p          # always keeps the first
    return torch.zeros_like(probs).scatter(0, order if head is None else head[order], sorted_p * keep)

"""The engine: one model on one device, one request at a time, --sessions conversations held.

    engine = Engine.open("model.pack", ServeConfig(device="sim:card.json"))
    for event in engine.stream(engine.codec.encode("Define: lantern"), SamplingParams(max_tokens=32)):
        print(event.text, end="")

Per request: pick the session (the conversation) the prompt continues, reuse the sequence
state of its longest common prefix with that session's tokens, prefill the rest in chunks,
then decode one token per step; the cache adapts between steps. Stats are kept for
generate --json, /v1/status and /metrics.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from moefit import kernels
from moefit.config import ServeConfig
from moefit.errors import DeviceOutOfMemory, UsageError
from moefit.memory import ledger as L
from moefit.memory.planner import NO_HEAD, NO_MTP, spec_mode
from moefit.pack import quant as dense
from moefit.pack.reader import Pack
from moefit.runtime.loader import Loaded, load
from moefit.runtime.recurrent_state import StateLost
from moefit.runtime import decode_graphs
from moefit.runtime.decode_graphs import DecodeGraphs
from moefit.runtime.decoding import CHUNK_DONE, token_stream
from moefit.runtime.draft_head import load_draft_head
from moefit.runtime.grammar import Constraint, GrammarTokenizer
from moefit.runtime.mtp import load_mtp
from moefit.runtime.sampler import Sampler, SamplingParams
from moefit.runtime.session import RequestStats, Session, SpecStats, common_prefix, reusable, session_for
from moefit.runtime.speculative import Window
from moefit.runtime.text import Detokenizer, StopMatcher, TextCodec


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]]           # the most likely tokens at this position, best first


@dataclass
class Event:
    token: int | None
    text: str
    finish_reason: str | None = None       # stop | length | cancelled
    logprob: TokenLogprob | None = None    # when the request asked for logprobs


FORK_MIN = 64               # prompt tokens a copy of another session must save to be made (Engine.place)
PAUSE = Event(None, "")      # stream(pauses=True): a prompt's prefill chunk done, nothing to send


def _session_field(name: str) -> property:
    return property(lambda self: getattr(self.session, name), lambda self, v: setattr(self.session, name, v))


class Engine:
    def __init__(self, loaded: Loaded, cfg: ServeConfig):
        self.cfg = cfg
        self.loaded = loaded
        self.pack: Pack = loaded.pack
        self.codec = TextCodec.load(self.pack.tokenizer_dir)
        self.eos_ids = self._eos_ids()
        self.spec_mode, self.spec_reason = self._spec_mode()
        self.draft_head = load_draft_head(self.pack, loaded) if self.spec_mode == "head" else None
        drafters = load_mtp(self.pack, loaded, cfg, loaded.kv.kv_dtype) if self.spec_mode == "mtp" else None
        # the conversations held: each one's tokens, sequence state, speculative window (and MTP KV)
        spec = SpecStats()                          # the engine's counters, whichever session drafted
        self.sessions = [Session(state, Window(cfg.spec_window), spec_stats=spec, mtp=drafters[i] if drafters else None)
                         for i, state in enumerate(loaded.states)]
        self.session = self.sessions[0]             # the one the current (or last) request runs on
        self.requests = 0
        self.steps = 0
        self._grammar_tokenizer = None              # llguidance's tokenizer, built on first use
        self.forwards = 0                           # forwards run: the watchdog's sign of progress
        self.decode_rate = 0.0                      # tokens/s of the last request that decoded
        self.graphs, self.graphs_off = self._decode_graphs()

    def _spec_mode(self) -> tuple[str, str]:
        plan, cfg = self.loaded.plan, self.cfg
        if plan is not None:
            return (plan.spec_reason.split(":")[0], plan.spec_reason) if plan.spec_enabled else ("off", plan.spec_reason)
        if cfg.spec == "off":
            return "off", "--spec off"
        if cfg.spec == "head" and not self.pack.draft:
            return "off", NO_HEAD
        if cfg.spec == "mtp" and not self.pack.mtp_layers:
            return "off", NO_MTP
        mode = spec_mode(cfg.spec, has_head=bool(self.pack.draft), mtp_layers=self.pack.mtp_layers)
        return mode, f"{mode}: window {cfg.spec_window} (cpu device: no reserve to check)"

    def _decode_graphs(self) -> tuple[DecodeGraphs | None, str | None]:
        """--decode-graphs: the recorded pieces of a decode step, or why there are none."""
        if self.cfg.decode_graphs == "off":
            return None, "--decode-graphs off"
        mem = self.loaded.mem
        why = decode_graphs.why_not(self.model, self.loaded.states, mem.device.kind)
        rows = lambda shape, dtype: mem.empty(L.GRAPHS, shape, dtype).zero_()   # noqa: E731 - the reserve's line
        return (None, why) if why else (DecodeGraphs(self.model, mem.torch_device, rows), None)

    def decode_graphs_json(self) -> dict:
        return {"on": True, **self.graphs.to_json()} if self.graphs else {"on": False, "why_not": self.graphs_off}

    @staticmethod
    def open(pack_path, cfg: ServeConfig, log=lambda msg: None) -> "Engine":
        pack = pack_path if isinstance(pack_path, Pack) else Pack.open(pack_path)
        return Engine(load(pack, cfg, log), cfg)

    @property
    def model(self):
        return self.loaded.model

    # -- the public view serve/ and the metrics read ------------------------------
    @property
    def plan(self):
        """The start's plan (the ledger, the serve check), or None on the cpu device."""
        return self.loaded.plan

    @property
    def cache(self):
        """The expert cache's book: slots by key, sizes, budget, hits and misses per layer."""
        return self.runner.book

    def cached_experts(self) -> int:
        return len(self.runner.slots)

    def context_tokens(self) -> int:
        """Tokens whose sequence state the engine holds (reusable by the next request)."""
        return len(self.kv_tokens)

    def free_device_bytes(self) -> int | None:
        """Free memory on the card now (None without one)."""
        return self.loaded.mem.snapshot().free_bytes if self.loaded.plan is not None else None

    @property
    def runner(self):
        return self.loaded.runner

    # the session's fields, as the engine's callers have long read them
    kv_tokens = _session_field("tokens")
    last = _session_field("last")
    hidden = _session_field("hidden")
    last_hidden = _session_field("last_hidden")
    spec_stats = _session_field("spec_stats")
    window = _session_field("window")
    mtp = _session_field("mtp")

    def _eos_ids(self) -> set[int]:
        ids = set(self.pack.model.eos_token_ids)
        gen = self.pack.generation_config().get("eos_token_id")
        ids.update(gen if isinstance(gen, list) else [gen] if gen is not None else [])
        eos = self.codec.token_id(self.codec.eos_token)
        return ids | ({eos} if eos is not None else set())

    # -- forward -----------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, tokens: list[int], start: int, last_only: bool = False) -> torch.Tensor:
        """Logits [T, V] (fp32) of tokens at positions start..start+T (or of the last one).
        A device out of memory (CUDA, or an overfilled simulated card) is DeviceOutOfMemory."""
        self.loaded.mem.check_fits()
        self.runner.catch_up()                 # the last forward's layers run without a wait: counted now
        self.forwards += 1
        self.runner.tokens += len(tokens)
        ids = torch.tensor(tokens, dtype=torch.long)
        try:
            if self.graphs is not None and self.graphs.takes(len(tokens), self.session.state) and \
                    self.model.probe_fit is None and not last_only:     # not a prompt's chunk
                h = self.graphs.forward(ids, start, self.session.state, self.runner)
            else:
                h = self.model.forward(ids, start, self.session.state, self.runner)
            if self.mtp is not None:
                self.mtp.observe(start, h)
            self.hidden = h[-1:] if last_only else h
            self.last_hidden = h[-1]
            return self.model.logits(self.hidden)
        except torch.OutOfMemoryError:
            raise DeviceOutOfMemory(f"CUDA out of memory in a forward of {len(tokens)} tokens") from None

    @torch.inference_mode()
    def keep(self, pos: int, tokens: list[int]) -> None:
        """After a verify window at pos only `tokens` (its first ones) stay: recurrent layers go
        back to their checkpoint after them, or, where they have none, the kept tokens run again."""
        try:
            self.session.state.keep(len(tokens))
        except StateLost:
            self.forward(tokens, pos)

    def prefill(self, prompt: list[int]) -> tuple[torch.Tensor, int]:
        """Logits of the last prompt token, reusing the session's sequence state for the longest
        common prefix it can resume at; returns (logits [V], reused tokens)."""
        steps = self.prefill_steps(prompt)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    def prefill_steps(self, prompt: list[int]) -> Iterator:
        """prefill, yielding CHUNK_DONE between its chunks (returns what prefill returns)."""
        reuse = common_prefix(self.kv_tokens, prompt)
        if reuse == len(prompt) and (logits := self._prompt_again(prompt)) is not None:
            return logits, reuse
        reuse = min(reuse, len(prompt) - 1)          # the last token must run to give logits
        if self.mtp is not None and reuse < len(self.kv_tokens):
            reuse = self._mtp_resume(reuse)
        reuse = self.session.state.resumable(reuse)  # recurrent layers resume only where they can
        self.kv_tokens = prompt[:reuse]
        chunk = self.cfg.prefill_chunk
        logits = None
        for start in range(reuse, len(prompt), chunk):
            if start > reuse:
                yield CHUNK_DONE
            piece = prompt[start:start + chunk]
            with kernels.torch_threads(dense.prompt_sized(len(piece))):   # large torch ops: all the threads
                logits = self.forward(piece, start, last_only=True)[0]
            self.kv_tokens = prompt[:start + len(piece)]
            if self.mtp is not None:
                self.mtp.catch_up(self.kv_tokens)
        self.session.mark_end(len(prompt), self.last_hidden, logits)   # where the next turn of this chat resumes
        return logits, reuse

    def _prompt_again(self, prompt: list[int]) -> torch.Tensor | None:
        """The same prompt as one this session consumed (a regenerated reply, a retried call): its
        last token's logits and hidden state were kept at its end and every layer resumes there, so
        nothing runs (a hybrid went back to its last snapshot, which verify windows had moved past:
        to 0). None where that end is not kept."""
        end = self.session.end_at(len(prompt))
        if end is None:
            return None
        device = self.loaded.mem.torch_device
        self.kv_tokens = list(prompt)
        self.last_hidden = end.hidden.to(device)
        self.hidden = self.last_hidden[None]
        if self.mtp is not None:                     # its row at the prompt's last token waits for the next token
            self.mtp.observe(len(prompt) - 1, self.hidden)
        return end.logits.to(device)

    def _mtp_resume(self, reuse: int) -> int:
        """The MTP's row at reuse - 1 was made with the old next token and is written again from the
        model's hidden state there: kept where a prompt ended, else the model runs that position again."""
        end = self.session.end_at(reuse)
        if end is None:
            return max(0, reuse - 1)
        self.mtp.observe(reuse - 1, end.hidden.to(self.loaded.mem.torch_device)[None])
        return reuse

    # -- generation --------------------------------------------------------------
    def check_request(self, prompt: list[int], params: SamplingParams) -> None:
        if not prompt:
            raise UsageError("the prompt is empty")
        if len(prompt) >= self.cfg.ctx:
            raise UsageError(f"the prompt has {len(prompt)} tokens; the context holds {self.cfg.ctx} "
                             "(one more is needed to generate)")

    def session_for(self, prompt: list[int]) -> Session:
        """The session a prompt runs on (runtime/session.py's session_for)."""
        return session_for(self.sessions, prompt)

    def place(self, prompt: list[int], busy: set[int]) -> tuple[Session, Session | None] | None:
        """Where a prompt runs while the sessions whose ids are in `busy` serve others: (the free
        session that session_for picks among the free ones, a session to copy into it first or
        None); None: no session is free. The copy (fork) is made where another session, busy or
        not, holds at least FORK_MIN more of the prompt: a sub-agent or a side request sharing a
        long system prompt with a conversation reuses it without overwriting that conversation."""
        free = [s for s in self.sessions if id(s) not in busy]
        if not free:
            return None
        target = session_for(free, prompt)
        reuse = {id(s): reusable(s, prompt) for s in self.sessions}      # a prefix walk each, once
        donor = max(self.sessions, key=lambda s: reuse[id(s)])
        return target, (donor if reuse[id(donor)] - reuse[id(target)] >= FORK_MIN else None)

    def fork(self, source: Session, target: Session) -> int:
        """target takes a copy of source's tokens and state (runtime/kept.py's fork)."""
        from moefit.runtime import kept
        with torch.inference_mode():
            return kept.fork(self, source, target)

    def stream(self, prompt: list[int], params: SamplingParams, cancelled: Callable[[], bool] = lambda: False,
               session: Session | None = None, pauses: bool = False) -> Iterator[Event]:
        """Generate from prompt token ids on `session` (by default the one session_for picks); yields
        text deltas, the last one with its finish reason, and with `pauses` PAUSE between a long
        prompt's prefill chunks. Other streams' steps, on other sessions, may run between two of
        its steps (serve's worker interleaves them)."""
        self.check_request(prompt, params)
        self.session = session = session or self.session_for(prompt)
        self.requests += 1
        self.session.used = self.requests
        stats = self.last = RequestStats(prompt_tokens=len(prompt))
        constraint = Constraint(GrammarTokenizer.of(self), params.grammar) if params.grammar else None
        sampler = Sampler(params, prompt, self.pack.model.vocab_size, constraint)
        detok, stops = Detokenizer(self.codec), StopMatcher(params.stop)
        budget = min(params.max_tokens, self.cfg.ctx - len(prompt))
        t0 = time.perf_counter()
        tokens = _pinned(self, session, token_stream(self, prompt, sampler, budget))
        try:
            for item in tokens:
                if item is CHUNK_DONE:
                    if pauses:
                        yield PAUSE
                    continue
                token, logits = item
                lp = _logprob(token, logits, params.logprobs)
                stats.generated.append(token)
                if len(stats.generated) == 1:
                    stats.first_token_s = stats.prefill_s = time.perf_counter() - t0
                reason = self._finish(token, params, len(stats.generated), budget)
                text, stopped = ("", False) if token in self.eos_ids and reason else stops.feed(detok.push(token))
                if stopped or reason or cancelled():
                    stats.decode_s = time.perf_counter() - t0 - stats.prefill_s
                    self.decode_rate = stats.decode_tokens_per_s or self.decode_rate
                    tail = "" if stopped else stops.flush()
                    yield Event(token, text + tail, "stop" if stopped else reason or "cancelled", lp)
                    return
                yield Event(token, text, logprob=lp)
        finally:
            tokens.close()
            self.runner.settle()               # the look-ahead's copies in flight: in the cache now

    def _finish(self, token: int, params: SamplingParams, n: int, budget: int) -> str | None:
        if (token in self.eos_ids and not params.ignore_eos) or token in params.stop_token_ids:
            return "stop"
        return "length" if n >= budget else None

    @torch.inference_mode()
    def decode_step(self, token: int, pos: int) -> torch.Tensor:
        logits = self.forward([token], pos)[0]
        self.kv_tokens.append(token)
        if self.mtp is not None:
            self.mtp.settle(self.kv_tokens)
        self.steps += 1
        if self.loaded.plan is not None and self.steps % self.cfg.swap_period == 0:
            self.runner.catch_up()
            for evict, admit in self.runner.book.swap_round():
                self.runner.swap(evict, admit)
        return logits

    def generate(self, prompt: list[int], params: SamplingParams) -> tuple[str, RequestStats, str]:
        """(text, stats, finish reason) in one call."""
        text, reason = [], None
        for event in self.stream(prompt, params):
            text.append(event.text)
            reason = event.finish_reason
        return "".join(text), self.last, reason

    def forget_prefix(self) -> None:
        """After a failed request the KV may hold a half-written step: reuse none of it."""
        self.kv_tokens = []

    def save_profile(self) -> None:
        self.runner.profile.save(self.pack.profile_path)


def _pinned(engine: Engine, session: Session, steps: Iterator) -> Iterator:
    """steps' items, each made with `session` as the engine's, whatever ran between two of them."""
    try:
        while True:
            engine.session = session
            try:
                item = next(steps)
            except StopIteration:
                return
            yield item
    finally:
        steps.close()


def _logprob(token: int, logits: torch.Tensor, top: int | None) -> TokenLogprob | None:
    """The model's log-probability of the token (its raw distribution) and the top alternatives."""
    if top is None:
        return None
    lp = torch.log_softmax(logits.float(), dim=-1)
    best = torch.topk(lp, top) if top else None
    pairs = list(zip(best.indices.tolist(), best.values.tolist())) if best is not None else []
    return TokenLogprob(token, float(lp[token]), pairs)

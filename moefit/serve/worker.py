"""One engine, one thread, a bounded FIFO queue, supervised.

Requests run on the engine's sessions (--sessions N): up to N at once, each on its own session,
their steps taken in turn (a prefill chunk, a decode step or a speculative window each), so a
short side request is answered while a long generation goes on rather than after it. A request
starts on the free session that session_for picks, given first a copy of another session's state
where that one holds a long prefix of its prompt (Engine.place: a sub-agent with the main agent's
system prompt reuses it, and the main conversation keeps its own); it waits only while every
session serves another. Each job's events are handed to its asyncio queue. A
cancelled job stops within one decode step. An exception while serving fails that request only
(OpenAI-shaped 4xx/5xx) and the engine goes on. When the engine cannot go on (its thread died,
the device reports a sticky error, or a forward made no progress for `stall_s`), the worker is
*dead*: every waiting and running request is answered 503, `/health` says 503, and `on_fatal`
tells the server to exit non-zero so a service manager restarts it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterator

from moefit.errors import DeviceOutOfMemory, DeviceUnavailable, MoefitError, UsageError
from moefit.runtime.engine import PAUSE
from moefit.runtime.sampler import SamplingParams
from moefit.serve.protocol import ApiError

log = logging.getLogger("moefit.worker")
# Device errors after which no later call can succeed in this process (CUDA's sticky errors).
STICKY = ("illegal memory access", "device-side assert", "unspecified launch failure",
          "an illegal instruction", "misaligned address", "CUDA error: unknown error")
SHUTDOWN_REASON = "abort"          # finish_reason of a stream ended by the server stopping (vLLM's word)


@dataclass
class Done:
    stats: object                  # RequestStats
    finish_reason: str


@dataclass
class Job:
    prompt: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    enqueued: float = field(default_factory=time.monotonic)

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:       # the event loop is closed: the server is gone, nobody listens
            pass


@dataclass
class Running:
    """A job on its session: the engine's stream of its events, stepped by the engine thread."""
    job: Job
    session: object
    source: object = None              # a session whose state this one takes first (Engine.place)
    events: Iterator = None
    started: float = field(default_factory=time.monotonic)
    stats: object = None


@dataclass
class Recent:
    time: float
    ttft_s: float
    decode_tokens_per_s: float
    prompt_tokens: int
    generated: int
    status: int


def is_sticky(error: BaseException) -> bool:
    return any(s in str(error) for s in STICKY)


class Worker:
    def __init__(self, engine, guard, metrics, max_queue: int, stall_s: float = 300.0,
                 on_fatal: Callable[[str], None] = lambda reason: None):
        self.engine, self.guard, self.metrics = engine, guard, metrics
        self.max_queue, self.stall_s, self.on_fatal = max_queue, stall_s, on_fatal
        self.waiting: deque[Job] = deque()
        self.running: list[Running] = []          # at most one a session, stepped in turn
        self.recent: deque[Recent] = deque(maxlen=100)
        self.fatal: str | None = None
        self.draining = False
        self._cv = threading.Condition()
        self._stop = False
        self._mean_s = 0.0                 # EMA wall seconds of a request, 0 until one finished
        self._beat = time.monotonic()      # last sign of progress of the running job
        self.thread = threading.Thread(target=self._supervised, name="moefit-engine", daemon=True)
        self.thread.start()
        threading.Thread(target=self._watch, name="moefit-watchdog", daemon=True).start()

    # -- the queue ------------------------------------------------------------------
    def submit(self, job: Job, admitted: bool = False) -> None:
        """Queue a job; a full queue is a 429, except for the next choice of a request already
        admitted (admitted=True: its n choices run one after another)."""
        with self._cv:
            if self.fatal or self.draining:
                raise ApiError(503, f"the server is {'stopping' if self.draining else 'down'} "
                               f"({self.fatal or 'shutdown'}); retry against a restarted server",
                               kind="server_error", code="unavailable", headers={"Retry-After": "5"})
            if len(self.waiting) >= self.max_queue and not admitted:
                retry = self.retry_after_s()
                raise ApiError(429, f"the queue is full ({len(self.waiting)} waiting); retry in {retry} s",
                               kind="rate_limit_exceeded", headers={"Retry-After": str(retry)})
            self.waiting.append(job)
            self._cv.notify()

    def retry_after_s(self) -> int:
        """Seconds until a place frees up: the running request's share of one mean request
        (the queue moves when it ends), at least 1 s."""
        mean = self._mean_s or 1.0
        return max(1, math.ceil(mean))

    def health(self) -> str | None:
        """None while serving; otherwise why the engine cannot go on."""
        return self.fatal

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()

    def drain(self) -> None:
        """The server is stopping: refuse new work, answer the waiting with 503, end the
        running stream at the next step with finish_reason 'abort'."""
        with self._cv:
            self.draining = True
            waiting, self.waiting = list(self.waiting), deque()
        for job in waiting:
            job.put(ApiError(503, "the server is shutting down", kind="server_error", code="shutdown"))
            job.put(None)

    def join(self, timeout_s: float) -> bool:
        self.stop()
        self.thread.join(timeout_s)
        return not self.thread.is_alive()

    # -- the engine thread ------------------------------------------------------------
    def _supervised(self) -> None:
        try:
            self._loop()
        except BaseException as e:                 # the loop itself broke: nothing will serve again
            log.exception("the engine thread died")
            self._die(f"the engine thread died ({type(e).__name__}: {e})")

    def _loop(self) -> None:
        while self._admit() and not self.fatal:
            for run in list(self.running):
                self._step(run)
                if self.fatal:
                    return

    def _admit(self) -> bool:
        """Waiting jobs onto free sessions (Engine.place; a job it cannot place waits, the others
        pass it); blocks while nothing runs or waits. False: stop."""
        with self._cv:
            while not self.running and not self.waiting and not self._stop:
                self._cv.wait()
            if self._stop and not self.running:
                return False
            busy = {id(r.session) for r in self.running}
            for job in [] if self._stop else list(self.waiting):
                placed = self.engine.place(job.prompt, busy)
                if placed is not None:
                    self.waiting.remove(job)
                    busy.add(id(placed[0]))
                    self.running.append(Running(job, *placed))
                    self._beat = time.monotonic()
        return True

    def _step(self, run: Running) -> None:
        """One item of a running job: its first step starts it (a cancelled job ends unstarted)."""
        if run.events is None:
            if run.job.cancelled.is_set():
                return self._end(run, None)
            run.events = self._events(run)
        try:
            item = next(run.events)
        except StopIteration:
            return self._end(run, 200)
        except ApiError as e:
            run.job.put(e)
            return self._end(run, e.status)
        if isinstance(item, Done):
            run.stats = item.stats
        if item is not PAUSE:
            run.job.put(item)
        elif run.job.cancelled.is_set():           # a prefill chunk done, and the client has gone:
            self._end(run, None)                   # the prompt's later chunks do not run

    def _end(self, run: Running, status: int | None) -> None:
        if run.events is not None:
            run.events.close()
        with self._cv:
            self.running.remove(run)
            self._cv.notify()
        run.job.put(None)
        if status is None:
            return
        took = time.monotonic() - run.started
        self._mean_s = took if not self._mean_s else 0.8 * self._mean_s + 0.2 * took
        self.metrics.finished(run.stats, status, took)
        if run.stats is not None:
            s = run.stats
            self.recent.append(Recent(time.time(), s.first_token_s, s.decode_tokens_per_s, s.prompt_tokens,
                                      len(s.generated), status))

    def _events(self, run: Running) -> Iterator:
        """A job's events, then its Done; every failure becomes the ApiError this request is answered with."""
        job = run.job
        try:
            self.engine.session = run.session          # what a failure before its first step forgets
            if run.source is not None:
                self.engine.fork(run.source, run.session)
            self.guard.before_request()
            finish = None
            stop = lambda: job.cancelled.is_set() or self.draining  # noqa: E731
            for event in self.engine.stream(job.prompt, job.params, cancelled=stop, session=run.session, pauses=True):
                self._beat = time.monotonic()
                if event.finish_reason == "cancelled" and self.draining:
                    event.finish_reason = SHUTDOWN_REASON
                finish = event.finish_reason or finish
                yield event
            yield Done(run.session.last, finish)
        except DeviceOutOfMemory as e:
            self.guard.after_oom(e)
            raise ApiError(503, f"the device ran out of memory during this request ({e}); the expert cache "
                           f"shrank to {self.engine.cached_experts()} experts; retry the request",
                           kind="server_error", code="device_out_of_memory") from None
        except UsageError as e:
            raise ApiError(400, str(e), param="messages") from None
        except DeviceUnavailable as e:
            self.engine.forget_prefix()
            raise ApiError(503, f"the device could not be read during this request ({e}); retry the request",
                           kind="server_error", code="device_unavailable", headers={"Retry-After": "1"}) from None
        except MoefitError as e:
            self.engine.forget_prefix()
            raise ApiError(500, str(e), kind="server_error") from None
        except Exception as e:                      # the supervision boundary: one request fails, not the server
            self._failed(e)                         # raises the ApiError

    def _failed(self, e: Exception):
        log.exception("request failed inside the engine")
        if is_sticky(e):
            self._die(f"the device reported an unrecoverable error ({e})")
            raise ApiError(503, "the device failed; the server is restarting", kind="server_error",
                           code="device_failed") from None
        self.engine.forget_prefix()
        raise ApiError(500, f"internal error while generating ({type(e).__name__}: {e}); the server goes on",
                       kind="server_error") from None

    # -- death and the watchdog -------------------------------------------------------
    def _die(self, reason: str, message: str | None = None, code: str = "unavailable") -> None:
        """Nothing will serve again: every waiting and running request is answered 503."""
        with self._cv:
            if self.fatal:
                return
            self.fatal = reason
            jobs = [r.job for r in self.running] + list(self.waiting)
            self.waiting = deque()
        log.error("moefit cannot go on: %s", reason)
        for job in jobs:
            job.put(ApiError(503, message or f"the server is down ({reason})", kind="server_error", code=code))
            job.put(None)
        self.on_fatal(reason)

    def _watch(self) -> None:
        """A forward that makes no progress for stall_s is a wedged engine: die loudly."""
        forwards = self.engine.forwards
        while not self._stop and not self.fatal:
            time.sleep(min(1.0, self.stall_s / 4))
            if self.engine.forwards != forwards:       # a prefill chunk counts as progress
                forwards, self._beat = self.engine.forwards, time.monotonic()
            if self.running and time.monotonic() - self._beat > self.stall_s:
                self._die(f"a request made no progress for {self.stall_s:.0f} s (the engine is wedged)",
                          "the engine stopped making progress; the server is restarting", code="stalled")

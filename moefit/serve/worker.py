"""One engine, one thread, a bounded FIFO queue, supervised.

Requests run one at a time; each job's events are handed to its asyncio queue. A cancelled
job stops within one decode step. An exception while serving fails that request only
(OpenAI-shaped 4xx/5xx) and the engine goes on. When the engine cannot go on (its thread
died, the device reports a sticky error, or a forward made no progress for `stall_s`),
the worker is *dead*: every waiting request is answered 503, `/health` says 503, and
`on_fatal` tells the server to exit non-zero so a service manager restarts it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from moefit.errors import DeviceOutOfMemory, DeviceUnavailable, MoefitError, UsageError
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
        self.running: Job | None = None
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
    def submit(self, job: Job) -> None:
        with self._cv:
            if self.fatal or self.draining:
                raise ApiError(503, f"the server is {'stopping' if self.draining else 'down'} "
                               f"({self.fatal or 'shutdown'}); retry against a restarted server",
                               kind="server_error", code="unavailable", headers={"Retry-After": "5"})
            if len(self.waiting) >= self.max_queue:
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
    def _next(self) -> Job | None:
        with self._cv:
            while not self.waiting and not self._stop:
                self._cv.wait()
            if self._stop:
                return None
            self.running = self.waiting.popleft()
            self._beat = time.monotonic()
            return self.running

    def _supervised(self) -> None:
        try:
            self._loop()
        except BaseException as e:                 # the loop itself broke: nothing will serve again
            log.exception("the engine thread died")
            self._die(f"the engine thread died ({type(e).__name__}: {e})")

    def _loop(self) -> None:
        while (job := self._next()) is not None:
            try:
                if not job.cancelled.is_set():
                    self._run(job)
            finally:
                job.put(None)
                with self._cv:
                    self.running = None
            if self.fatal:
                return

    def _run(self, job: Job) -> None:
        t0 = time.monotonic()
        try:
            stats, status = self._generate(job), 200
        except ApiError as e:
            stats, status = None, e.status
            job.put(e)
        self._mean_s = (time.monotonic() - t0) if not self._mean_s else 0.8 * self._mean_s + 0.2 * (
            time.monotonic() - t0)
        self.metrics.finished(stats, status, time.monotonic() - t0)
        if stats is not None:
            self.recent.append(Recent(time.time(), stats.first_token_s, stats.decode_tokens_per_s,
                                      stats.prompt_tokens, len(stats.generated), status))

    def _generate(self, job: Job):
        """Run one job; every failure becomes the ApiError this request is answered with."""
        try:
            self.guard.before_request()
            finish = None
            stop = lambda: job.cancelled.is_set() or self.draining  # noqa: E731
            for event in self.engine.stream(job.prompt, job.params, cancelled=stop):
                self._beat = time.monotonic()
                if event.finish_reason == "cancelled" and self.draining:
                    event.finish_reason = SHUTDOWN_REASON
                job.put(event)
                finish = event.finish_reason or finish
            job.put(Done(self.engine.last, finish))
            return self.engine.last
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
            return self._failed(e)

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
    def _die(self, reason: str) -> None:
        with self._cv:
            if self.fatal:
                return
            self.fatal = reason
            waiting, self.waiting = list(self.waiting), deque()
        log.error("moefit cannot go on: %s", reason)
        for job in waiting:
            job.put(ApiError(503, f"the server is down ({reason})", kind="server_error", code="unavailable"))
            job.put(None)
        self.on_fatal(reason)

    def _watch(self) -> None:
        """A forward that makes no progress for stall_s is a wedged engine: die loudly."""
        forwards = self.engine.forwards
        while not self._stop and not self.fatal:
            time.sleep(min(1.0, self.stall_s / 4))
            if self.engine.forwards != forwards:       # a prefill chunk counts as progress
                forwards, self._beat = self.engine.forwards, time.monotonic()
            running = self.running
            if running is not None and time.monotonic() - self._beat > self.stall_s:
                self._die(f"a request made no progress for {self.stall_s:.0f} s (the engine is wedged)")
                running.put(ApiError(503, "the engine stopped making progress; the server is restarting",
                                     kind="server_error", code="stalled"))
                running.put(None)

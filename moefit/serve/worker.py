"""One engine, one thread, a bounded FIFO queue. Requests run one at a time; each job's
events are handed to its asyncio queue. A cancelled job stops within one decode step."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from moefit.errors import DeviceOutOfMemory, UsageError
from moefit.runtime.sampler import SamplingParams
from moefit.serve.protocol import ApiError


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
        self.loop.call_soon_threadsafe(self.events.put_nowait, item)


@dataclass
class Recent:
    time: float
    ttft_s: float
    decode_tokens_per_s: float
    prompt_tokens: int
    generated: int
    status: int


class Worker:
    def __init__(self, engine, guard, metrics, max_queue: int):
        self.engine, self.guard, self.metrics = engine, guard, metrics
        self.max_queue = max_queue
        self.waiting: deque[Job] = deque()
        self.running: Job | None = None
        self.recent: deque[Recent] = deque(maxlen=100)
        self._cv = threading.Condition()
        self._stop = False
        self._mean_s = 2.0
        self.thread = threading.Thread(target=self._loop, name="moefit-engine", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> None:
        with self._cv:
            if len(self.waiting) >= self.max_queue:
                retry = max(1, int(self._mean_s * (len(self.waiting) + 1)))
                raise ApiError(429, f"the queue is full ({len(self.waiting)} waiting); retry in {retry} s",
                               kind="rate_limit_exceeded", headers={"Retry-After": str(retry)})
            self.waiting.append(job)
            self._cv.notify()

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()

    def _next(self) -> Job | None:
        with self._cv:
            while not self.waiting and not self._stop:
                self._cv.wait()
            if self._stop:
                return None
            self.running = self.waiting.popleft()
            return self.running

    def _loop(self) -> None:
        while (job := self._next()) is not None:
            try:
                if not job.cancelled.is_set():
                    self._run(job)
            finally:
                job.put(None)
                with self._cv:
                    self.running = None

    def _run(self, job: Job) -> None:
        t0 = time.monotonic()
        status, stats = 200, None
        try:
            self.guard.before_request()
            finish = None
            for event in self.engine.stream(job.prompt, job.params, cancelled=job.cancelled.is_set):
                job.put(event)
                finish = event.finish_reason or finish
            stats = self.engine.last
            job.put(Done(stats, finish))
        except DeviceOutOfMemory as e:
            status = 503
            self.guard.after_oom(e)
            job.put(ApiError(503, f"the device ran out of memory during this request ({e}); the expert cache "
                             f"shrank to {len(self.engine.runner.slots)} experts; retry the request",
                             kind="server_error", code="device_out_of_memory"))
        except UsageError as e:
            status = 400
            job.put(ApiError(400, str(e), param="messages"))
        self._mean_s = 0.8 * self._mean_s + 0.2 * (time.monotonic() - t0)
        self.metrics.finished(stats, status, time.monotonic() - t0)
        if stats is not None:
            self.recent.append(Recent(time.time(), stats.first_token_s, stats.decode_tokens_per_s,
                                      stats.prompt_tokens, len(stats.generated), status))

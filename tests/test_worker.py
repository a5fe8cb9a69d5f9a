"""The supervised engine thread: a failing request fails alone, a dead or wedged engine
makes the server say so (and exit), and stopping ends the running stream cleanly."""

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from moefit.runtime.engine import PAUSE
from moefit.runtime.sampler import SamplingParams
from moefit.serve.metrics import Metrics
from moefit.serve.protocol import ApiError
from moefit.serve.worker import Done, Job, Worker


class FakeEngine:
    """Streams `n` tokens per request; `fail` decides, per request, what to raise. A prompt's
    first token picks its session (of `sessions`); each step notes the session it ran on."""

    def __init__(self, sessions: int = 1):
        self.fail = None
        self.block = threading.Event()
        self.forwards = 0
        self.prefix_forgotten = 0
        last = lambda: SimpleNamespace(first_token_s=0.01, decode_tokens_per_s=100.0, prompt_tokens=1,  # noqa: E731
                                       generated=[1, 2], cached_tokens=0)
        self.sessions = [SimpleNamespace(last=last()) for _ in range(sessions)]
        self.steps = []                          # (session index, token index) of each step, in order
        self.chunks, self.prefilled = 1, 0       # prefill chunks a prompt takes; chunks run
        self.runner = SimpleNamespace(slots={})

    def session_for(self, prompt):
        return self.sessions[prompt[0] % len(self.sessions)]

    def place(self, prompt, busy):
        own = self.session_for(prompt)
        return (own, None) if id(own) not in busy else None

    def stream(self, prompt, params, cancelled, session=None, pauses=False):
        if self.fail == "block":
            self.block.wait(10)
        elif self.fail is not None:
            raise self.fail
        for _ in range(self.chunks if pauses else 0):
            time.sleep(0.005)
            self.prefilled += 1
            yield PAUSE                          # a prefill chunk: the worker sends nothing for it
        for i in range(params.max_tokens):
            time.sleep(0.005)
            self.forwards += 1
            self.steps.append((next(k for k, s in enumerate(self.sessions) if s is session), i))
            last = i == params.max_tokens - 1
            yield SimpleNamespace(token=i, text="x", finish_reason="length" if last else None)
            if cancelled() and not last:
                yield SimpleNamespace(token=i, text="", finish_reason="cancelled")
                return

    def forget_prefix(self):
        self.prefix_forgotten += 1


def run_jobs(worker, *max_tokens, prompts=None):
    """Submit jobs and collect every item each one receives, until its closing None."""
    async def go():
        loop = asyncio.get_running_loop()
        jobs = [Job(p, SamplingParams(max_tokens=n), loop) for n, p in zip(max_tokens, prompts or [[1]] * len(max_tokens))]
        with worker._cv:                         # all queued before the engine thread takes any
            for job in jobs:
                worker.submit(job)

        async def drain(job):
            items = []
            while (item := await asyncio.wait_for(job.events.get(), 10)) is not None:
                items.append(item)
            return items
        return await asyncio.gather(*(drain(j) for j in jobs))
    return asyncio.run(go())


@pytest.fixture(params=[1])
def made(request):
    engine = FakeEngine(request.param)
    died = []
    worker = Worker(engine, SimpleNamespace(before_request=lambda: None), Metrics(), max_queue=4, stall_s=0.6,
                    on_fatal=died.append)
    yield engine, worker, died
    engine.block.set()
    worker.join(5)


def test_an_exception_fails_that_request_with_a_500_and_the_engine_goes_on(made):
    engine, worker, died = made
    engine.fail = OverflowError("int too big to convert")
    [items] = run_jobs(worker, 3)
    assert isinstance(items[-1], ApiError) and items[-1].status == 500 and "OverflowError" in items[-1].message
    assert engine.prefix_forgotten == 1
    engine.fail = None
    [items] = run_jobs(worker, 3)
    assert isinstance(items[-1], Done) and worker.health() is None and not died


def test_a_sticky_device_error_kills_the_engine_and_the_server_is_told(made):
    engine, worker, died = made
    engine.fail = RuntimeError("CUDA error: an illegal memory access was encountered")
    [items] = run_jobs(worker, 3)
    assert items[-1].status == 503
    assert died and "unrecoverable" in worker.health()
    with pytest.raises(ApiError) as e:
        run_jobs(worker, 1)
    assert e.value.status == 503


def test_a_wedged_engine_is_noticed_by_the_watchdog(made):
    engine, worker, died = made
    engine.fail = "block"
    [items] = run_jobs(worker, 3)
    assert items[-1].status == 503 and "no progress" in worker.health() and died


def test_draining_ends_the_running_stream_with_abort_and_answers_the_waiting_503(made):
    engine, worker, died = made
    threading.Timer(0.1, worker.drain).start()
    running, waiting = run_jobs(worker, 400, 5)
    assert running[-1].finish_reason == "abort" and 1 < len(running) < 400
    assert isinstance(waiting[-1], ApiError) and waiting[-1].status == 503
    assert worker.join(5) and not died


def test_retry_after_follows_the_measured_request_time(made):
    engine, worker, died = made
    run_jobs(worker, 5, 5, 5)
    assert worker.retry_after_s() == 1                         # requests of ~25 ms: a place frees within 1 s
    worker._mean_s = 7.2
    assert worker.retry_after_s() == 8


@pytest.mark.parametrize("made", [2], indirect=True)
def test_requests_on_two_sessions_take_their_steps_in_turn(made):
    """A short side request on the other session is answered while a long one goes on."""
    engine, worker, died = made
    long, short = run_jobs(worker, 60, 5, prompts=[[0], [1]])
    assert isinstance(long[-1], Done) and isinstance(short[-1], Done) and len(long) == 61
    ones = [i for i, (s, _) in enumerate(engine.steps) if s == 1]
    assert ones == [1, 3, 5, 7, 9]                                         # alternating with the long one
    assert worker.running == [] and not died


@pytest.mark.parametrize("made", [2], indirect=True)
def test_a_request_the_engine_cannot_place_waits_and_others_pass_it(made):
    """The fake engine places a request on its own session only: two for session 0 run one after
    the other; one for session 1 runs beside them."""
    engine, worker, died = made
    first, second, other = run_jobs(worker, 20, 3, 3, prompts=[[0], [2], [1]])
    assert all(isinstance(items[-1], Done) for items in (first, second, other))
    on0 = [i for s, i in engine.steps if s == 0]
    assert on0 == list(range(20)) + list(range(3))                       # the second after the first, whole
    assert engine.steps.index((1, 2)) < engine.steps.index((0, 19))       # the other did not wait for them


@pytest.mark.parametrize("made", [2], indirect=True)
def test_a_wedged_engine_answers_every_running_request(made):
    engine, worker, died = made
    engine.fail = "block"
    items = run_jobs(worker, 3, 3, prompts=[[0], [1]])
    assert all(i[-1].status == 503 and i[-1].code == "stalled" for i in items) and died


def test_a_requests_next_choice_is_queued_past_a_full_queue(made):
    """n choices run one after another: the second is not refused because others queued meanwhile."""
    engine, worker, died = made
    assert worker.join(5)                                   # nothing takes jobs off the queue now
    loop = asyncio.new_event_loop()
    for _ in range(4):
        worker.submit(Job([1], SamplingParams(max_tokens=1), loop))
    with pytest.raises(ApiError) as e:
        worker.submit(Job([1], SamplingParams(max_tokens=1), loop))
    assert e.value.status == 429
    worker.submit(Job([1], SamplingParams(max_tokens=1), loop), admitted=True)
    assert len(worker.waiting) == 5
    loop.close()


def test_a_client_gone_during_a_long_prefill_stops_it_within_a_chunk(made):
    engine, worker, died = made
    engine.chunks = 400

    async def go():
        job = Job([1], SamplingParams(max_tokens=5), asyncio.get_running_loop())
        worker.submit(job)
        await asyncio.sleep(0.1)
        job.cancelled.set()                      # what the server does when the client hangs up
        return [item async for item in _until_none(job)]
    assert asyncio.run(go()) == [] and 0 < engine.prefilled < 100 and worker.running == []
    engine.chunks = 1
    [items] = run_jobs(worker, 3)
    assert isinstance(items[-1], Done)


async def _until_none(job):
    while (item := await asyncio.wait_for(job.events.get(), 10)) is not None:
        yield item

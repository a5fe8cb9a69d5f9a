"""The look-ahead's copies made off the engine thread (experts/stager.py), on a host-memory card:
the worker copies, `landed` orders the copy before the slot is read, a worker's error comes
back on the engine thread, and the engine's output does not change."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from moefit.experts.stager import Stager


class SlowSlot:
    """A slot whose copy takes a while and says which thread made it."""

    def __init__(self, fail: bool = False):
        self.data, self.thread, self.fail = None, None, fail

    def copy_(self, blob: torch.Tensor) -> None:
        time.sleep(0.2)
        if self.fail:
            raise OSError("the pack's file went away")
        self.thread, self.data = threading.current_thread().name, blob.clone()


def test_the_worker_copies_and_landed_waits_for_it():
    stager = Stager(torch.device("cpu"), largest_blob=16)
    slot, blob = SlowSlot(), torch.arange(16, dtype=torch.uint8)
    t0 = time.perf_counter()
    ticket = stager.send((3, 5), blob, slot)
    assert time.perf_counter() - t0 < 0.1 and slot.data is None        # send returns at once
    stager.landed(ticket)
    assert torch.equal(slot.data, blob) and slot.thread == "moefit-stager"
    assert stager.sent == 1


def test_a_blob_given_as_a_function_is_made_on_the_worker():
    """The runner sends its view of the pack's map as a function: the view is made off the engine thread."""
    stager = Stager(torch.device("cpu"), largest_blob=16)
    made_on, slot, blob = [], SlowSlot(), torch.full((16,), 7, dtype=torch.uint8)

    def view():
        made_on.append(threading.current_thread().name)
        return blob
    stager.landed(stager.send((1, 2), view, slot))
    assert made_on == ["moefit-stager"] and torch.equal(slot.data, blob)


def test_a_workers_error_is_raised_on_the_engine_thread_and_the_next_copy_still_runs():
    stager = Stager(torch.device("cpu"), largest_blob=16)
    bad = stager.send((0, 1), torch.zeros(4, dtype=torch.uint8), SlowSlot(fail=True))
    good_slot = SlowSlot()
    good = stager.send((0, 2), torch.ones(4, dtype=torch.uint8), good_slot)
    with pytest.raises(OSError, match="went away"):
        stager.landed(bad)
    stager.landed(good)
    assert torch.equal(good_slot.data, torch.ones(4, dtype=torch.uint8))


def test_jobs_sent_together_reach_the_worker_as_one_in_their_order():
    """together() (a prefetch's copies and read-aheads): one item on the worker's queue at the
    block's end, the jobs run in the order they were given; a landed() inside the block sends
    what it holds first, so a block never waits on its own copy."""
    stager = Stager(torch.device("cpu"), largest_blob=16)
    held, gate, order = threading.Event(), threading.Event(), []
    stager.call(lambda: (held.set(), gate.wait()))          # the worker is held: the queue fills
    held.wait()
    with stager.together():
        tickets = [stager.send((0, i), torch.full((16,), i, dtype=torch.uint8), torch.empty(16, dtype=torch.uint8))
                   for i in range(3)]
        stager.call(lambda: order.append("read-ahead"))
        assert stager._work.qsize() == 0 and stager.backlog == 3
    assert stager._work.qsize() == 1
    gate.set()
    for ticket in tickets:
        stager.landed(ticket)
    stager.call(lambda: order.append("after"))
    with stager.together():
        late = stager.send((1, 0), torch.zeros(16, dtype=torch.uint8), SlowSlot())
        waits = threading.Thread(target=stager.landed, args=(late,), daemon=True)   # as the engine thread would
        waits.start()
        waits.join(10)
        assert not waits.is_alive() and late.issued.is_set()   # held, it would wait forever
    stager.close()
    assert order == ["read-ahead", "after"] and stager.backlog == 0


def test_prefetches_land_through_the_stager_and_the_tokens_do_not_change(packs, card):
    from moefit.config import ServeConfig
    from moefit.runtime.engine import Engine
    from moefit.runtime.sampler import SamplingParams
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompt = [5, 17, 42, 99, 7, 3, 150, 220]
    base = dict(device=f"sim:{card(64)}", ctx=64, vram_reserve_mib=1, low_headroom_mib=0, min_expert_slots=0,
                expert_cache="4")
    runs = {}
    for ahead in (0, 2):
        engine = Engine.open(packs("qwen3_moe", "int8"), ServeConfig(**base, prefetch_per_layer=ahead))
        runs[ahead] = engine.generate(prompt, greedy)[1].generated
        stager = engine.runner.stager
        if ahead:
            assert stager is not None and stager.sent > 0 and engine.runner.book.swaps >= stager.sent
            assert not engine.runner.arriving and len(engine.runner.slots) == 4      # settled at the request's end
        else:
            assert stager is None
    assert runs[0] == runs[2]


def test_where_a_layer_does_not_wait_a_late_copy_is_a_miss_and_the_tokens_do_not_change(packs, card):
    """CUDA's setting (wait_for_prefetch False), on a host-memory card: the worker is held up, so
    no prefetch has landed when its layer runs; the layer computes those experts on the host and
    counts them late, not prefetch hits, and lands them once the worker goes on. While it is held
    up, no more than one layer's budget (2) is sent to it."""
    from moefit.config import ServeConfig
    from moefit.runtime.engine import Engine
    from moefit.runtime.sampler import SamplingParams
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompt = [5, 17, 42, 99, 7, 3, 150, 220]
    cfg = ServeConfig(device=f"sim:{card(64)}", ctx=64, vram_reserve_mib=1, low_headroom_mib=0, min_expert_slots=0,
                      expert_cache="4", prefetch_per_layer=2)
    want = Engine.open(packs("qwen3_moe", "int8"), cfg).generate(prompt, greedy)[1].generated
    engine = Engine.open(packs("qwen3_moe", "int8"), cfg)
    runner, go = engine.runner, threading.Event()
    runner.wait_for_prefetch = False
    runner.staging().call(lambda: go.wait(30))               # every copy sent after this waits for go
    runner.settle = lambda: None                             # the request's end would wait for them
    t0 = time.perf_counter()
    got = engine.generate(prompt, greedy)[1].generated
    assert time.perf_counter() - t0 < 20 and got == want
    sent, late = runner.stager.sent, runner.ahead.prefetch_late
    assert 0 < sent <= 2 and late > 0 and runner.ahead.prefetch_hits == 0 and len(runner.arriving) == sent
    assert runner.stager.backlog == sent          # a worker a layer's budget behind is sent no more
    go.set()
    del runner.settle
    runner.settle()
    assert not runner.arriving and len(runner.slots) == 4


def test_at_exit_the_worker_finishes_its_jobs_before_it_stops():
    """Stager.close (run for every stager at exit): a job cut off inside torch or the native
    kernel while the interpreter goes down aborts the process, so the worker drains first."""
    worker, done = Stager(torch.device("cpu"), 16), []
    worker.call(lambda: (time.sleep(0.2), done.append(1)))
    worker.close()
    assert done == [1] and not worker._thread.is_alive()
    worker.close(timeout_s=0.1)                                # again (at exit, after a close): returns at once

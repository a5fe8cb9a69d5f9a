"""The look-ahead's copies into the cache, made off the engine thread.

    ticket = stager.send(key, blob, slot)   # returns at once; a worker copies blob (or blob()) into slot
    stager.call(job)                        # ... or runs job() (a page read-ahead)
    ...                                     # the engine thread goes on with the layer
    stager.landed(ticket)                   # before the slot is read: its copy is ordered first
    with stager.together(): ...             # the jobs sent inside go to the worker as one

A prefetch's blob comes from the pack's map (pageable host memory). On CUDA the worker copies
it into a pinned staging buffer (a ring of `depth` buffers of the largest blob, allocated once)
and from there into the slot on the side stream, recording an event; `landed` makes the compute
stream wait for that event (the device waits, not the host). The host-side copy, ~0.15-0.35 ms
a 2.4 MB blob on the H200's host, is what took the engine thread's time when it made each
pinned copy itself (torch's pin_memory). On a host-memory card (cpu, a simulated card) the
worker copies straight into the slot, and `landed` waits for it: the same order, the same
thread, so the tests see what CUDA does.

A buffer of the ring is written again only after the copy that read it has run (its event,
waited on by the worker). A worker's error is raised on the engine thread, at the ticket's
`landed`.
"""

from __future__ import annotations

import atexit
import queue
import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

STAGING_BYTES = 256 << 20      # the pinned ring holds 2-4 of the largest blob, at most this many bytes beyond two


@dataclass(eq=False)
class Ticket:
    key: tuple[int, int]
    slot: torch.Tensor                        # the view the blob is copied into
    issued: threading.Event = field(default_factory=threading.Event)
    event: object = None                      # the CUDA copy's event
    error: BaseException | None = None


_live: "weakref.WeakSet[Stager]" = weakref.WeakSet()


@atexit.register
def _drain() -> None:
    """At exit each worker finishes its jobs and stops first: one cut off inside torch or the
    native kernel while the interpreter goes down aborts the process ("terminate called")."""
    for stager in list(_live):
        stager.close()


class Stager:
    def __init__(self, device: torch.device, largest_blob: int, depth: int = 4):
        self.device, self.cuda = device, device.type == "cuda"
        self.stream = torch.cuda.Stream(device=device) if self.cuda else None
        self._ring = (torch.empty(depth, largest_blob, dtype=torch.uint8, pin_memory=True) if self.cuda else None)
        self._free: queue.Queue = queue.Queue()
        for i in range(depth if self.cuda else 0):
            self._free.put((i, None))
        self._work: queue.Queue = queue.Queue()
        self._held: list | None = None            # jobs of a together() block, not yet the worker's
        self.sent = 0
        self.issued = 0                           # copies the worker has issued (done, on a host-memory card)
        self._thread = threading.Thread(target=self._run, name="moefit-stager", daemon=True)
        self._thread.start()
        _live.add(self)

    def close(self, timeout_s: float = 10.0) -> None:
        """Let the worker finish what it was given, then stop it."""
        self._work.put(None)
        self._thread.join(timeout_s)

    def send(self, key: tuple[int, int], blob, slot: torch.Tensor) -> Ticket:
        """blob: the bytes, or a function giving them, called on the worker (the runner's view of
        the pack's map: a tensor op, tens of us on the engine thread with its caches cold)."""
        ticket = Ticket(key, slot)
        self._put(lambda: self._copy(ticket, blob))
        self.sent += 1
        return ticket

    @contextmanager
    def together(self):
        """The jobs sent and called inside go to the worker as one, in their order, at the block's
        end: one wake-up. A prefetch sends two or three copies and a job of ten read-aheads, and
        each put that woke the worker cost the engine thread 30-45 us (a GIL hand-off and a futex
        call; ~60-100 us for eleven, against one's 30-45, measured here)."""
        if self._held is not None:                # nested: the outer block sends them
            yield
            return
        self._held = []
        try:
            yield
        finally:
            self._flush()

    def _put(self, job) -> None:
        if self._held is None:
            self._work.put(job)
        else:
            self._held.append(job)

    def _flush(self) -> None:
        jobs, self._held = self._held, None
        self._hand_over(jobs)

    def _hand_over(self, jobs: list) -> None:
        """A together() block's jobs to the worker: one queue item."""
        if jobs:
            self._work.put(jobs[0] if len(jobs) == 1 else lambda: [job() for job in jobs])

    @property
    def backlog(self) -> int:
        """Copies sent that the worker has not issued yet."""
        return self.sent - self.issued

    def call(self, job) -> None:
        """Run job() on the worker, after the copies sent before it (the look-ahead's page
        read-aheads: a madvise each, ~40 us of the engine thread's time where it made them)."""
        self._put(job)

    def landed(self, ticket: Ticket) -> None:
        """The slot's copy is ordered before what the compute stream does next (CUDA), or done."""
        if self._held:                            # a together() block waits for its own job: send them now
            jobs, self._held = self._held, []
            self._hand_over(jobs)
        ticket.issued.wait()
        if ticket.error is not None:
            raise ticket.error
        if ticket.event is not None:
            torch.cuda.current_stream().wait_event(ticket.event)

    def _run(self) -> None:
        if self.cuda:
            torch.cuda.set_device(self.device)
        while (job := self._work.get()) is not None:
            job()

    def _copy(self, ticket: Ticket, blob) -> None:
        try:
            blob = blob() if callable(blob) else blob
            if self.cuda:
                self._through_ring(ticket, blob)
            else:
                ticket.slot.copy_(blob)
        except BaseException as e:  # noqa: BLE001 - raised again on the engine thread, at landed()
            ticket.error = e
        finally:
            self.issued += 1                      # the worker's alone: the engine thread only reads it
            ticket.issued.set()

    def _through_ring(self, ticket: Ticket, blob: torch.Tensor) -> None:
        i, last = self._free.get()
        if last is not None:
            last.synchronize()                    # the copy that read this buffer has run
        staged = self._ring[i, : blob.numel()]
        staged.copy_(blob)
        with torch.cuda.stream(self.stream):
            ticket.slot.copy_(staged, non_blocking=True)
            ticket.event = torch.cuda.Event()
            ticket.event.record(self.stream)
        self._free.put((i, ticket.event))

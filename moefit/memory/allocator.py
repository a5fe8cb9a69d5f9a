"""What an allocation really costs on a card: the rounding model a simulated card charges by.
No torch.

`exact`: an allocation of n bytes costs n bytes, and freeing it gives them back at once.
Scaled cards (the demo's, 1:480) use it: a 2 MiB segment would be 8 % of such a card.

`cuda`: PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp, defaults):
  - every block is rounded up to a multiple of 512 bytes (what memory_allocated counts);
  - blocks of at most 1 MiB are carved from 2 MiB segments ("small pool");
  - blocks over 1 MiB and under 10 MiB from 20 MiB segments ("large pool");
  - blocks of 10 MiB and more get a segment of their size rounded up to 2 MiB;
  - a freed block stays in its segment (reserved, what NVML sees) until empty_cache()
    gives back the segments that are entirely free.
A segment serves a block when its unused bytes cover it: fragmentation inside a segment
and block splitting limits (max_split_size) are not modelled, so the model is a lower
bound on what the driver holds. A 2.5 MiB expert allocated alone therefore reserves its
share of a 20 MiB segment and evicting it returns nothing until the whole segment is empty,
which is why the expert cache allocates its slots in chunks of 10 MiB and more (experts/slots.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

MIB = 1 << 20
MIN_BLOCK = 512
SMALL_SIZE = 1 * MIB
SMALL_SEGMENT = 2 * MIB
LARGE_SEGMENT = 20 * MIB
MIN_LARGE_ALLOC = 10 * MIB
ROUND_LARGE = 2 * MIB
MODELS = ("exact", "cuda")


def round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def block_bytes(n: int) -> int:
    """What memory_allocated counts for a request of n bytes."""
    return max(MIN_BLOCK, round_up(n, MIN_BLOCK))


def segment_bytes(block: int) -> int:
    """The segment cudaMalloc gets when no cached segment can serve the block."""
    if block <= SMALL_SIZE:
        return SMALL_SEGMENT
    if block < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return round_up(block, ROUND_LARGE)


@dataclass
class Segment:
    size: int
    small: bool
    used: int = 0


@dataclass
class AllocatorModel:
    """Usage: a = AllocatorModel("cuda"); h = a.allocate(3 << 20); a.free(h); a.empty_cache()"""

    model: str = "exact"
    segments: list[Segment] = field(default_factory=list)
    blocks: dict[int, tuple[int, Segment | None]] = field(default_factory=dict)
    _next: int = 0

    def __post_init__(self):
        if self.model not in MODELS:
            raise ValueError(f"unknown allocator model {self.model!r} (one of {', '.join(MODELS)})")

    @property
    def allocated(self) -> int:
        return sum(size for size, _ in self.blocks.values())

    @property
    def reserved(self) -> int:
        if self.model == "exact":
            return self.allocated
        return sum(s.size for s in self.segments)

    def cost(self, nbytes: int) -> int:
        """How much `reserved` grows if nbytes were allocated now."""
        if self.model == "exact":
            return nbytes
        block = block_bytes(nbytes)
        return 0 if self._segment_for(block) is not None else segment_bytes(block)

    def allocate(self, nbytes: int) -> int:
        """A handle for free(). The caller checks cost() against the card first."""
        self._next += 1
        if self.model == "exact":
            self.blocks[self._next] = (nbytes, None)
            return self._next
        block = block_bytes(nbytes)
        seg = self._segment_for(block)
        if seg is None:
            seg = Segment(segment_bytes(block), block <= SMALL_SIZE)
            self.segments.append(seg)
        seg.used += block
        self.blocks[self._next] = (block, seg)
        return self._next

    def free(self, handle: int) -> None:
        size, seg = self.blocks.pop(handle)
        if seg is not None:
            seg.used -= size

    def empty_cache(self) -> int:
        """Give the entirely free segments back to the driver; returns the bytes given back."""
        before = self.reserved
        self.segments = [s for s in self.segments if s.used > 0]
        return before - self.reserved

    def _segment_for(self, block: int) -> Segment | None:
        small = block <= SMALL_SIZE
        for seg in self.segments:
            if seg.small == small and seg.size - seg.used >= block:
                return seg
        return None

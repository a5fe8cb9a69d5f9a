"""How the expert cache's slots are laid out on the card. No torch: the planner prices a
cache with the same functions the pool allocates it by, so the ledger's expert-cache line
is the pool's allocation, exactly.

Experts are grouped by blob size ("size classes": a mixed-quant pack has one per quant).
A class's slots are `stride` bytes apart (the blob rounded up to 256 bytes, so every part
stays aligned) in chunks of about CHUNK_TARGET bytes. A chunk of 10 MiB or more is a
multiple of 2 MiB: under the CUDA caching allocator it is its own segment, so what the
card reserves for the pool is what the pool allocated, and freeing a chunk gives it back
to the driver (memory/allocator.py). A class smaller than that is one chunk rounded to
512 bytes, packed with other blocks the way the allocator packs them.
"""

from __future__ import annotations

from collections import Counter

from moefit.memory.allocator import MIN_BLOCK, MIN_LARGE_ALLOC, ROUND_LARGE, round_up

ALIGN = 256
CHUNK_TARGET = 64 << 20
MIN_CHUNKS = 16

Key = tuple[int, int]


def stride(blob_bytes: int) -> int:
    return round_up(blob_bytes, ALIGN)


def chunk_bytes(slots: int, slot_stride: int) -> int:
    raw = slots * slot_stride
    return round_up(raw, ROUND_LARGE) if raw >= MIN_LARGE_ALLOC else round_up(raw, MIN_BLOCK)


def chunk_plan(count: int, slot_stride: int) -> list[int]:
    """Slots per chunk for `count` slots of one class: at least MIN_CHUNKS chunks (so the
    guard can give memory back in steps) of at most about CHUNK_TARGET, each of them 10 MiB
    or more when the class is that large; a rest too small for its own segment joins the
    chunk before it."""
    if count <= 0:
        return []
    per = slots_per_chunk(count, slot_stride)
    chunks = [per] * (count // per) + ([count % per] if count % per else [])
    if len(chunks) > 1 and chunks[-1] * slot_stride < MIN_LARGE_ALLOC <= count * slot_stride:
        chunks[-2] += chunks.pop()
    return chunks


def slots_per_chunk(count: int, slot_stride: int) -> int:
    total = count * slot_stride
    n = max(min(MIN_CHUNKS, count), -(-total // CHUNK_TARGET))
    if total >= MIN_LARGE_ALLOC:
        n = max(1, min(n, total // MIN_LARGE_ALLOC))
    per = -(-count // n)
    if per * slot_stride < MIN_LARGE_ALLOC:
        return per
    # of the counts from half of per to twice per (within the target), the one whose 2 MiB
    # rounding wastes least per slot
    top = max(per, min(2 * per, CHUNK_TARGET // slot_stride))
    waste = lambda k: (chunk_bytes(k, slot_stride) - k * slot_stride) / k  # noqa: E731
    return min((k for k in range(max(1, per // 2), top + 1) if k * slot_stride >= MIN_LARGE_ALLOC),
               key=lambda k: (waste(k), -k))


def class_counts(keys: list[Key], sizes: dict[Key, int]) -> Counter:
    """Slots needed per stride."""
    return Counter(stride(sizes[k]) for k in keys)


def pool_bytes(keys: list[Key], sizes: dict[Key, int]) -> int:
    """What the pool allocates to hold `keys`."""
    return sum(chunk_bytes(n, s) for s, count in class_counts(keys, sizes).items() for n in chunk_plan(count, s))


def fit(keys: list[Key], sizes: dict[Key, int], budget: int) -> list[Key]:
    """The hottest prefix of keys whose pool fits the budget."""
    keys = list(keys)
    while keys and pool_bytes(keys, sizes) > budget:
        keys.pop()
    return keys


def slots_bytes(count: int, blob_bytes: int) -> int:
    """The pool for `count` slots of blob_bytes each (--expert-cache N, the minimum cache)."""
    s = stride(blob_bytes)
    return sum(chunk_bytes(n, s) for n in chunk_plan(count, s))


def slots_fitting(nbytes: int, blob_bytes: int) -> int:
    """How many slots of blob_bytes a pool of at most nbytes holds."""
    n = max(0, nbytes // stride(blob_bytes))
    while n and slots_bytes(n, blob_bytes) > nbytes:
        n -= 1
    return n

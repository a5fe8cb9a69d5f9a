"""moefit: serve Mixture-of-Experts models larger than the GPU, every byte explained."""

import os

__version__ = "0.1.0"

# torch's OpenMP workers spin a while after each parallel region (GOMP's default) on the cores
# the native pool's threads then need: on 2 cores ~15 % of a prompt's samples (perf, AMD EPYC) were
# libgomp spinning. Passive workers sleep at once: those samples gone, a 128-token prompt 1-4 %
# faster (alternating runs; the noise is of that order; `active`, spinning for good, ran it 25 %
# slower), decode unchanged (its torch keeps one thread). Only where the user set no policy, and
# only before torch is loaded: moefit first (the CLI and the server import it so).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# A prompt's tensors on pages mapped once, not faulted in and zeroed again each chunk (host_heap.py).
from moefit.host_heap import keep_freed_memory  # noqa: E402

HEAP_KEPT = keep_freed_memory()

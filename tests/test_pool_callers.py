"""Two threads calling the native pool at once (an engine's posted layer calls beside another
thread's native work: a second engine's in the same process): each gets its own numbers and neither
waits for ever (kernels/pool.h's callers' turns)."""

from __future__ import annotations

import threading

import pytest
import torch

from moefit import kernels
from moefit.pack.quant import quantize
from test_kernels import make

ROUNDS = 300


def in_threads(*jobs, timeout: float = 60.0) -> list[str]:
    """Runs each job on a daemon thread of its own; the errors they report, or 'hung'."""
    errors: list[str] = []
    threads = [threading.Thread(target=job, args=(errors,), daemon=True) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return errors + ["hung"] * sum(t.is_alive() for t in threads)


@pytest.mark.skipif(kernels.library() is None, reason="no native library")
def test_posted_layer_calls_and_another_threads_native_calls_each_get_their_own_numbers():
    kernels.set_threads(2)
    try:
        x, experts, rows, weights = make("int8", 256, 128, 4, 3, seed=7)
        layer = kernels.moe_layer(x, "int8", experts, rows, weights)
        codes, scale = quantize(torch.randn(512, 256, generator=torch.Generator().manual_seed(8)), "int8", 32)
        parts = {"w": codes, "w.scale": scale}
        matrix = kernels.dequantize(parts, "w", "int8")

        def posting(errors):
            for _ in range(ROUNDS):
                if not torch.equal(kernels.moe_layer(x, "int8", experts, rows, weights), layer):
                    errors.append("layer")

        def dequantizing(errors):
            for _ in range(ROUNDS):
                if not torch.equal(kernels.dequantize(parts, "w", "int8"), matrix):
                    errors.append("dequantize")

        assert in_threads(posting, dequantizing) == []
    finally:
        kernels.set_threads(kernels.default_threads())

"""A MoE layer's resident experts on the device in two launches, read through the slot table
(experts/slot_table.py) and the router's ids as they are on the device: the step can be queued
before the host has seen the routing, so the GPU runs the resident experts while the host waits
for the hand-off and computes the misses.

    out = resident_sum(x, ids, weights, table_row, base, shape, act)     # [T, E] fp32; 0 for the misses

CUDA's room in `kernels/`, next to device_experts.py (one matrix for a group of experts the host
chose); the kernels are in triton_moe.py, imported on first use. `usable` says where it runs: on
CUDA with Triton, or on the CPU under TRITON_INTERPRET=1 (how the tests run it), for experts
stored as int4, Q8_0 or int8, or as a GGUF file's Q4_K / Q5_K / Q6_K / IQ4_XS super-blocks (a
Q4_K_M file's layers, Q4_K gate and up with Q6_K down, too) or MXFP4 blocks, for steps of at most
DENSE_TOKENS rows. The expert function is SwiGLU, or gpt-oss's biased and clamped one where the
family gives its `ClampedAct`. Elsewhere experts/runner.py takes its grouped path
(experts/grouped.py), which gives the same numbers.

Per weight the stored byte is read once per 4 token rows for gate_up and once per token for
down (a decode step reads each resident expert once); every sum is fp32, summed over a token's
ranks in the router's order.

Legend: T tokens, k top-k, E hidden, I an expert's intermediate size.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import lru_cache

import torch

from moefit.kernels import device_experts
from moefit.pack.layout import Part, matrix_quants

KINDS = device_experts.KINDS
GGUF_KINDS = {"q4_k": 3, "q6_k": 4, "q5_k": 5, "iq4_xs": 6, "mxfp4": 7}     # a file's blocks, read 32 weights at a time
ROWS = 4                                 # token rows a gate_up program holds
BLOCK = 32

broken: str | None = None                # why the kernels would not compile here, once they did not


@dataclass(frozen=True)
class BlobShape:
    """Where a blob's matrices are and how they are coded: byte offsets of gate_up, its scales,
    down and its scales; gate_up's kind; each matrix's group (columns a scale covers); down's kind."""
    offsets: tuple[int, int, int, int]
    kind: int
    hidden: int
    inter: int
    gate_up_group: int
    down_group: int
    down_kind: int


@dataclass(frozen=True)
class ClampedAct:
    """gpt-oss's expert function for a layer (models/gpt_oss.py): its experts' biases on the device,
    gate_up [N, 2I] (gate then up) and down [N, E], and the gate's alpha and clamp limit."""
    gate_up_bias: torch.Tensor
    down_bias: torch.Tensor
    alpha: float
    limit: float


def blob_shape(layout: list[Part], quant: str) -> BlobShape | None:
    """The blob's shape for the kernels, or None where they cannot read it (a float expert, two of
    the pack's own kinds in one blob, a group that is not a power of two of at least 16)."""
    gate_up, down = matrix_quants(quant)
    parts = {p.name: p for p in layout}
    inter, hidden = parts["gate_up"].shape[0] // 2, parts["down"].shape[0]
    if gate_up in GGUF_KINDS and down in GGUF_KINDS:
        offsets = (parts["gate_up"].offset, 0, parts["down"].offset, 0)
        return BlobShape(offsets, GGUF_KINDS[gate_up], hidden, inter, 32, 32, GGUF_KINDS[down])
    if gate_up != down or gate_up not in KINDS:
        return None
    if gate_up == "int8":
        groups = (device_experts.INT8_STEP, device_experts.INT8_STEP)
    else:
        groups = (hidden // parts["gate_up.scale"].shape[1], inter // parts["down.scale"].shape[1])
    if any(g < 16 or g & (g - 1) for g in groups) or hidden % groups[0] or inter % groups[1]:
        return None
    offsets = tuple(parts[n].offset for n in ("gate_up", "gate_up.scale", "down", "down.scale"))
    return BlobShape(offsets, KINDS[gate_up], hidden, inter, *groups, KINDS[gate_up])


@lru_cache(maxsize=1)
def _kernels():
    try:
        from moefit.kernels import triton_moe
    except ImportError:
        return None
    return triton_moe


def usable(x: torch.Tensor) -> bool:
    """Triton is here and x is where it runs (CUDA, or the CPU under its interpreter)."""
    return broken is None and (x.is_cuda or device_experts.interpreted()) and _kernels() is not None


def resident_sum(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, table_row: torch.Tensor,
                 base: torch.Tensor, shape: BlobShape, act: ClampedAct | None = None) -> torch.Tensor | None:
    """sum over each token's ranks r whose expert ids[t, r] has a slot (table_row[e] != 0) of
    weights[t, r] * expert_e(x[t]) (SwiGLU, or act's), fp32 [T, E]; None, and never again in this
    process, where the kernels do not compile (the caller's grouped path runs)."""
    try:
        return _resident_sum(x, ids, weights, table_row, base, shape, act)
    except Exception as e:  # noqa: BLE001 - compilation errors come in many types; the grouped path is exact
        global broken
        broken = f"{type(e).__name__}: {e}"[:300]
        warnings.warn(f"moefit: the slot-table expert kernels are off, the grouped path runs ({broken})",
                      stacklevel=2)
        return None


def _resident_sum(x, ids, weights, table_row, base, shape: BlobShape, act: ClampedAct | None) -> torch.Tensor:
    tokens, k = ids.shape
    x, ids, weights = x.contiguous(), ids.contiguous(), weights.contiguous()
    h = torch.empty(tokens * k, shape.inter, dtype=torch.float32, device=x.device)
    out = torch.empty(tokens, shape.hidden, dtype=torch.float32, device=x.device)
    run = _kernels()
    for t0 in range(0, tokens, ROWS):
        run.launch_gate_up(x[t0:], ids[t0:], table_row, base, h[t0 * k:], min(ROWS, tokens - t0), k, shape.inter,
                           shape.hidden, shape.offsets, shape.gate_up_group, shape.kind, BLOCK, act)
    run.launch_down(h, ids, weights, table_row, base, out, tokens, k, shape.inter, shape.hidden, shape.offsets,
                    shape.down_group, shape.down_kind, BLOCK, act)
    return out

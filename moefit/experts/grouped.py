"""A layer's resident experts on the device in a few launches, not a few per expert.

    out = grouped_swiglu(x, stack_parts(views), quant, combine)   # [T, E] fp32

Per expert, an int4 SwiGLU was ~40 operations (unpack, scale, cast, two matmuls, the gate), so
eight resident experts of a 48-layer model cost ~16,000 a token: at ~5 us a launch the GPU
waits on the launcher, not on memory. Here the parts of a group of experts (as many as the
plan's scratch holds: memory/footprint.resident_group, up to 8) are stacked (one launch a
part), multiplied together as batched matmuls, and summed with
their router weights in fp32: the launches of a layer do not grow with how many of its
experts are resident (tests/test_grouped.py counts them).

Every resident expert runs on every row of the step (the combine matrix holds 0 where a
token did not route to it), so this is for steps of at most DENSE_TOKENS rows (decode,
verify windows), where reading the weights, not the multiply, is the cost. Larger steps
(prefill chunks) run each group on its experts' own rows, padded to the longest (experts of
similar row counts grouped together, at most top-k of them, so the padded rows are at most the
chunk's top-k pairs: experts/runner.py). Each matrix is multiplied in slices
of its rows so that the scratch stays within what the plan holds for it
(memory/footprint.expert_scratch_bytes).

On CUDA with Triton, int4 / Q8_0 / int8 matrices of a few rows go through one fused kernel each
(kernels/device_experts.py: the stored codes read once, fp32 sums): a layer's group is then
about ten launches and reads each weight's byte once.

The numbers: int8's per-row scale, and for a few rows int4 / Q8_0's per-group scales, apply
in fp32 after their multiply (the codes are exact in any compute dtype); otherwise the matrix
is dequantised (pack/quant.dequantize: codes times scales in fp32, rounded once). The sum is
in fp32. In fp32 all of these agree; in bf16 the per-group scaling is closer to the host's
exact weights than a dequantised bf16 matrix is.

Legend: m experts, T tokens, E hidden, I an expert's intermediate size, R / C a matrix's rows / columns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from moefit.kernels import device_experts
from moefit.pack.layout import matrix_quant
from moefit.pack.quant import dequantize, int4_codes

DENSE_TOKENS = 16      # steps up to this many rows run every resident expert on every row


def stack_parts(views: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Each part of m experts' blob views stacked: name -> [m, *shape] (one launch a part; one
    expert's are views, no copy)."""
    if len(views) == 1:
        return {name: t[None] for name, t in views[0].items()}
    return {name: torch.stack([v[name] for v in views]) for name in views[0]}


@dataclass(frozen=True)
class GroupAct:
    """A family's own expert function for a group of m experts (gpt-oss: biases, a clamped gate):
    their biases gate_up [m, 2I] and down [m, E] on the device, and h = act(gate, up) (which may
    overwrite gate and up: they are the call's own)."""
    gate_up_bias: torch.Tensor
    down_bias: torch.Tensor
    act: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def grouped_swiglu(x: torch.Tensor, parts: dict[str, torch.Tensor], quant: str, combine: torch.Tensor,
                   slice_weights: int, act: GroupAct | None = None) -> torch.Tensor:
    """sum_j combine[j, t] * swiglu_j(x[t]) in fp32: x [T, E], parts [m, ...], combine [m, T]."""
    return (swiglu_each(x, parts, quant, slice_weights, act).float() * combine[:, :, None]).sum(0)


def swiglu_each(x: torch.Tensor, parts: dict[str, torch.Tensor], quant: str, slice_weights: int,
                act: GroupAct | None = None) -> torch.Tensor:
    """Each expert's SwiGLU (or the family's `act`) of x [T, E] (the same rows for all) or
    [m, T, E] (its own): [m, T, E]; each matrix multiplied in slices of at most slice_weights
    weights an expert."""
    gate_up = _sliced_linear(x, parts, "gate_up", quant, slice_weights)                       # [m, T, 2I]
    del x                                      # a prefill group's gathered rows: not held past here
    if act is None:
        gate, up = gate_up.chunk(2, dim=-1)
        h = F.silu(gate).mul_(up)
    else:                                      # gate_up is this call's own: biased and gated in place
        gate, up = gate_up.add_(act.gate_up_bias[:, None, :].to(gate_up.dtype)).chunk(2, dim=-1)
        h = act.act(gate, up)
    del gate_up, gate, up
    y = _sliced_linear(h, parts, "down", quant, slice_weights)
    return y if act is None else y.add_(act.down_bias[:, None, :].to(y.dtype))


def padded_rows(starts: list[tuple[int, int]], rows: torch.Tensor, weights: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """A prefill step's group: expert j's token rows rows[a_j:b_j] and router weights, as
    [m, R] (R the most rows any of them has), padded with row 0 at weight 0."""
    most = max(b - a for a, b in starts)
    index, weight = torch.zeros(len(starts), most, dtype=torch.long), torch.zeros(len(starts), most)
    for j, (a, b) in enumerate(starts):
        index[j, : b - a], weight[j, : b - a] = rows[a:b].long(), weights[a:b].float()
    return index, weight


def _sliced_linear(x: torch.Tensor, parts: dict[str, torch.Tensor], name: str, quant: str,
                   slice_weights: int) -> torch.Tensor:
    """_batched_linear over row slices of the matrix, so its scratch stays within the plan's
    (a Mixtral expert's gate_up dequantised whole would hold ~1 GiB)."""
    mine = {k: v for k, v in parts.items() if k.split(".")[0] == name}
    q = matrix_quant(quant, name)
    if x.shape[-2] <= DENSE_TOKENS and device_experts.usable(x, q, mine, name):
        fused = device_experts.matvec(x, mine, name, q)             # fp32, no scratch (CUDA + Triton)
        if fused is not None:
            return fused
    rows, step = mine[name].shape[1], max(1, slice_weights // x.shape[-1])
    if step >= rows:
        return _batched_linear(x, mine, name, quant)
    return torch.cat([_batched_linear(x, {k: v[:, a:a + step] for k, v in mine.items()}, name, quant)
                      for a in range(0, rows, step)], dim=-1)


def _batched_linear(x: torch.Tensor, parts: dict[str, torch.Tensor], name: str, quant: str) -> torch.Tensor:
    """x [T, C] or [m, T, C] times each expert's matrix `name` [m, R, C] transposed: [m, T, R]."""
    w, q = parts[name], matrix_quant(quant, name)
    if q == "int8":                           # codes are exact in bf16 / fp16; the row scale after, in fp32
        y = torch.matmul(x, w.to(x.dtype).transpose(1, 2))
        return (y.float() * parts[name + ".scale"].float()[:, None, :]).to(x.dtype)
    if q in ("int4", "q8_0") and x.shape[-2] <= DENSE_TOKENS:
        return _group_scaled(x, _codes(w, q), parts[name + ".scale"])
    m, rows = w.shape[:2]                     # larger steps, K-quants, MXFP4, float experts: dequantised first
    flat = {k: v.flatten(0, 1) for k, v in parts.items()}
    return torch.matmul(x, dequantize(flat, name, quant, x.dtype).view(m, rows, -1).transpose(1, 2))


def _codes(w: torch.Tensor, quant: str) -> torch.Tensor:
    """A matrix's codes as int8 [m, R, C]."""
    return w if quant == "q8_0" else int4_codes(w)


def _group_scaled(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """sum over column groups of scale[r, G] * (x's group G . codes[r]'s group G): the codes are
    exact in the compute dtype and each group's scale applies in fp32 after its multiply, so no
    dequantised [m, R, C] matrix (fp32 then compute dtype) is ever made. [m, T, R]"""
    m, rows, cols = codes.shape
    groups = scale.shape[2]
    xg = x.unflatten(-1, (groups, cols // groups)).transpose(-3, -2)                  # [(m,) G, T, g]
    cg = codes.to(x.dtype).view(m, rows, groups, -1).permute(0, 2, 3, 1)             # [m, G, g, R]
    partial = torch.matmul(xg, cg)                                                    # [m, G, T, R]
    return (partial.float() * scale.float().permute(0, 2, 1)[:, :, None, :]).sum(1).to(x.dtype)


def combine_matrix(experts: int, tokens: int, rows: torch.Tensor, start: list[int],
                   weights: torch.Tensor) -> torch.Tensor:
    """[m, T] fp32 on the host: the router weight of expert j for token t, 0 where t did not route to j
    (groups' layout: expert j's token rows are rows[start[j]:start[j + 1]])."""
    out = torch.zeros(experts, tokens)
    which = torch.repeat_interleave(torch.arange(experts), torch.tensor(start).diff())
    out.index_put_((which, rows.long()), weights.float())
    return out

"""A layer's routing grouped by expert, and the plain SwiGLU expert (experts/runner.py uses both).

Legend: T tokens, E hidden, k top-k, I an expert's intermediate size.
"""

from __future__ import annotations

from array import array

import torch
import torch.nn.functional as F

from moefit.pack import quant as dense
from moefit.pack.quant import gemm_linear, qlinear


class Groups:
    """A layer's (token, expert, weight) triples grouped by expert, experts ascending:
    experts[i]'s tokens are rows[start[i]:start[i + 1]], with their router weights."""

    def __init__(self, experts: list[int], start: list[int], rows: torch.Tensor, weights: torch.Tensor,
                 token_weights: list[float] | None = None):
        self.experts, self.start, self.rows, self.weights = experts, start, rows, weights
        self.token_weights = token_weights      # a decode step's: the weights as floats (subset's, no tensor read)

    @staticmethod
    def of(ids: torch.Tensor, weights: torch.Tensor, routed: list[list[int]] | None = None) -> "Groups":
        """ids, weights [T, k] on the host (`routed`: ids as lists, where the caller has them)."""
        if ids.shape[0] == 1:                   # a decode step: k distinct experts, sorted in Python
            (row,), (w,) = routed or ids.tolist(), weights.tolist()
            return Groups.of_token(row, w)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
        start = [0] + torch.cumsum(counts, 0).tolist()
        rows = (order // ids.shape[1]).to(torch.int32)
        return Groups(experts.tolist(), start, rows, weights.reshape(-1)[order].float())

    @staticmethod
    def of_token(experts: list[int], weights: list[float]) -> "Groups":
        """One token's routing (k distinct experts in the router's order, their weights) grouped:
        the experts ascending."""
        order = sorted(range(len(experts)), key=experts.__getitem__)
        return Groups._one_token([experts[i] for i in order], [weights[i] for i in order])

    @staticmethod
    def _one_token(experts: list[int], weights: list[float]) -> "Groups":
        """A decode step's groups: one row each, every row token 0; the weights' tensor from an
        array (torch.tensor's half the time)."""
        return Groups(experts, list(range(len(experts) + 1)), _token_zero(len(experts)),
                      torch.frombuffer(array("f", weights), dtype=torch.float32) if weights else torch.zeros(0),
                      weights)

    def rows_of(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """experts[i]'s token rows (int64) and router weights."""
        a, b = self.start[i], self.start[i + 1]
        return self.rows[a:b].long(), self.weights[a:b]

    def busy(self, tokens: int, least: int) -> list[bool]:
        """Which experts of a prompt chunk (pack/quant.py's GEMM_TOKENS tokens or more) have at least
        `least` rows, from which two fp32 GEMMs on their dequantised matrices outpace the integer
        dots on this machine (ExpertRunner.gemm_rows; gemm_first). Decode steps and verify windows
        keep the dots."""
        if not dense.prompt_sized(tokens):
            return [False] * len(self.experts)
        return [b - a >= least for a, b in zip(self.start, self.start[1:])]

    def subset(self, keep: list[bool]) -> "Groups":
        """The groups of the experts where keep is true, in the same order: a decode step's from its
        floats, others' picks indexed once from a Python list (an arange a group and a cat took
        70 us for a decode step's misses, 140-170 us for 16 tokens', with the engine thread's
        caches cold: tens of us a tensor op there)."""
        idx = [i for i, k in enumerate(keep) if k]
        if self.token_weights is not None:
            return Groups._one_token([self.experts[i] for i in idx], [self.token_weights[i] for i in idx])
        start, sel = [0], []
        for i in idx:
            a, b = self.start[i], self.start[i + 1]
            sel += range(a, b)
            start.append(start[-1] + b - a)
        pick = torch.tensor(sel, dtype=torch.long)
        return Groups([self.experts[i] for i in idx], start, self.rows[pick], self.weights[pick])


_ZEROS: dict[int, torch.Tensor] = {}


def _token_zero(k: int) -> torch.Tensor:
    """[k] int32 zeros, made once per k: a decode step's rows (every expert takes token 0). Only
    read (rows_of and subset copy)."""
    rows = _ZEROS.get(k)
    if rows is None:
        rows = _ZEROS[k] = torch.zeros(k, dtype=torch.int32)
    return rows


def expert_forward(x: torch.Tensor, parts: dict[str, torch.Tensor], quant: str, linear=qlinear) -> torch.Tensor:
    """SwiGLU expert on x [T, E] from a blob's parts (gate_up [2I, E], down [E, I]); linear is
    qlinear, or gemm_first for a prompt chunk's busy experts."""
    gate, up = linear(x, parts, "gate_up", quant).chunk(2, dim=-1)
    return linear(F.silu(gate) * up, parts, "down", quant)


def gemm_first(x: torch.Tensor, parts: dict[str, torch.Tensor], name: str, quant: str) -> torch.Tensor:
    """x @ W^T as torch's fp32 GEMM on W dequantised natively (the caller holds
    kernels.torch_threads()), or qlinear where the kernel does not take W."""
    y = gemm_linear(x, parts, name, quant)
    return y if y is not None else qlinear(x, parts, name, quant)


def gemm_forward(x: torch.Tensor, parts: dict[str, torch.Tensor], quant: str) -> torch.Tensor:
    """The SwiGLU expert on x [T, E] fp32 as two fp32 GEMMs on its matrices dequantised natively."""
    return expert_forward(x, parts, quant, gemm_first)

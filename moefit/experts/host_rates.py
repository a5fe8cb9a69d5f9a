"""How fast this machine's host runs a layer's experts, timed on the pack's own experts through
the runner's host call (experts/runner.py `_host_experts`):

    rates.measure(gemm)      (bytes/s, MACs/s) of the dots or of a busy expert's GEMMs, at start:
                             the PCIe-or-host choice's rates (experts/costs.py MissCosts)
    rates.gemm_rows(l, q)    the rows from which a prompt chunk's expert of quant q runs as GEMMs:
                             --expert-gemm-rows N, never with off, and with auto where the two
                             paths cross here (costs.crossover), timed at the first prompt chunk
    rates.busy(...)          each expert's choice in a step: GEMMs or dots
"""

from __future__ import annotations

import time

import torch

from moefit.experts.costs import NEVER, crossover, measure_host
from moefit.experts.groups import Groups
from moefit.pack import quant as dense


class HostRates:
    def __init__(self, runner, setting: str = "auto"):
        self.runner = runner
        self.setting = setting                     # --expert-gemm-rows: auto, N, or off
        self.crossovers: dict[str, int] = {}       # quant -> rows from which a prompt's expert runs as GEMMs
        self._timed = 0                            # experts timed so far (each timing takes the next ones)

    def measure(self, gemm: bool = False) -> tuple[float, float]:
        """(bytes/s, MACs/s) of the host path on this pack's experts: the integer dots (1 and 64
        rows), or a busy expert's fp32 GEMMs (one and two prompt chunks' worth of rows:
        GEMM_TOKENS and twice that), a different expert each call (its weights come from memory)."""
        r = self.runner
        layer = r.pack.model.moe_layers[0]
        macs = 3 * r._shape(r.pack.blobs[(layer, 0)].quant)[0] * r.pack.model.hidden_size
        run_one = lambda rows: self.time_experts(layer, rows, gemm, experts=1)  # noqa: E731
        rows = (2 * dense.GEMM_TOKENS, dense.GEMM_TOKENS) if gemm else (64, 1)
        return measure_host(run_one, r.book.sizes[(layer, 0)], macs, *rows)

    def gemm_rows(self, layer: int, quant: str) -> int:
        """Rows from which a prompt chunk's expert of `quant` runs as two fp32 GEMMs rather than the
        integer dots (Groups.busy), measured on this layer's experts the first time it is asked
        (~0.5 s once) with auto."""
        if self.setting != "auto":
            return NEVER if self.setting == "off" else int(self.setting)
        if quant not in self.crossovers:
            self.crossovers[quant] = crossover(lambda rows, gemm: self.time_experts(layer, rows, gemm))
        return self.crossovers[quant]

    def busy(self, layer: int, quant: str, groups: Groups, tokens: int) -> list[bool]:
        """Each expert's choice in a step of `tokens` tokens: GEMMs (a prompt chunk's busy ones) or dots."""
        return groups.busy(tokens, self.gemm_rows(layer, quant) if dense.prompt_sized(tokens) else NEVER)

    def reported(self) -> dict[str, int | None]:
        """The measured crossovers for /v1/status (None: never)."""
        return {q: None if rows >= NEVER else rows for q, rows in self.crossovers.items()}

    def time_experts(self, layer: int, rows: int, gemm: bool, experts: int = 8) -> float:
        """Seconds a host call of `experts` of the layer's experts (the next ones each call), `rows`
        random rows each, takes, timed as a prompt chunk runs them: all as dots, or the first as
        GEMMs. The host's native pool and torch's threads then take turns, which on some machines
        costs more than the GEMMs save (an AMD EPYC, 2 cores: 8 experts of 64 rows, all dots 4.3 ms
        an expert, half as GEMMs 4.7, where one expert alone was 5.1 as dots and 3.9 as GEMMs):
        the two lines cross where the first GEMM expert of a layer pays for that too."""
        model = self.runner.pack.model
        ids = torch.tensor([(self._timed + i) % model.num_experts for i in range(experts)])
        self._timed += experts
        groups = Groups.of(ids.repeat_interleave(rows)[:, None], torch.ones(rows * experts, 1))
        x = torch.randn(rows * experts, model.hidden_size)
        t0 = time.perf_counter()
        self.runner._host_experts(layer, x, groups, busy=[gemm and i == 0 for i in range(len(groups.experts))])
        return time.perf_counter() - t0

"""Qwen3-Next (qwen3_next; declaration in families/qwen3_next.py): the hybrid stack Qwen3.5 /
3.6-MoE inherited, computed by models/qwen3_5_moe.py. Only the checkpoint differs: DeltaNet's
projections are two fused matrices whose rows are grouped by key head, [q, k, v, z] per head
in in_proj_qkvz and [b, a] per head in in_proj_ba. They are reordered at load into Qwen3.5's
layout (all q rows, all k, all v, all z, all b, all a), so both families share one forward.
"""

from __future__ import annotations

import torch

from moefit.models.layers import Weights
from moefit.models.qwen3_5_moe import Qwen3_5Moe


class Qwen3Next(Qwen3_5Moe):
    def in_proj(self, w: Weights, a: str):
        hk, hv, dk, dv, _ = self.dims
        r = hv // hk                                           # value heads per key head

        def by_part(t: torch.Tensor) -> torch.Tensor:
            qkvz, ba = t[:hk * (2 * dk + 2 * r * dv)], t[hk * (2 * dk + 2 * r * dv):]
            q, k, v, z = qkvz.view(hk, 2 * dk + 2 * r * dv, -1).split([dk, dk, r * dv, r * dv], dim=1)
            b, a_ = ba.view(hk, 2 * r, -1).split([r, r], dim=1)
            return torch.cat([x.reshape(-1, t.shape[-1]) for x in (q, k, v, z, b, a_)], dim=0)

        return w.fused([a + "in_proj_qkvz.weight", a + "in_proj_ba.weight"], reorder=by_part)

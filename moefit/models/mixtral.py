"""Mixtral: plain GQA attention (no QK-norm), optional sliding window, and a router
whose top-k probabilities are always renormalised (softmax over the chosen k).

Legend: T tokens, E hidden, H heads, K kv heads, D head dim, N experts, k top-k.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moefit.models.layers import DecoderModel, RopeTable, Weights, apply_rope, attend_state, linear, output_weights


class Mixtral(DecoderModel):
    def __init__(self, cfg, w: Weights, rope: RopeTable):
        self.cfg, self.rope = cfg, rope
        self.layers = [self._layer(w, i) for i in range(cfg.num_layers)]
        self.embed, self.norm, self.lm_head = output_weights(cfg, w)

    def _layer(self, w: Weights, i: int) -> dict:
        p = f"model.layers.{i}."
        a = p + "self_attn."
        return {
            "input_norm": w.get(p + "input_layernorm.weight"),
            "post_norm": w.get(p + "post_attention_layernorm.weight"),
            "qkv": w.fused([a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"]),
            "o": w.get(a + "o_proj.weight"),
            "router": w.get(p + "mlp.gate.weight"),
        }

    def attention(self, i, layer, x, start, cos, sin, mask, kv) -> torch.Tensor:
        c = self.cfg
        t, hd = x.shape[0], c.head_dim
        q, k, v = linear(x, layer["qkv"]).split([c.num_heads * hd, c.num_kv_heads * hd, c.num_kv_heads * hd], -1)
        q = q.view(t, c.num_heads, hd).transpose(0, 1)                                   # [H, T, D]
        k = k.view(t, c.num_kv_heads, hd).transpose(0, 1)                                # [K, T, D]
        v = v.view(t, c.num_kv_heads, hd).transpose(0, 1)                                # [K, T, D]
        kv.write(i, start, apply_rope(k, cos, sin), v)
        return linear(attend_state(kv, i, apply_rope(q, cos, sin), start, mask), layer["o"])

    def mlp(self, i, layer, x, experts) -> torch.Tensor:
        probs = F.softmax(F.linear(x, layer["router"]).float(), dim=-1)                 # [T, N]
        weights, ids = torch.topk(probs, self.cfg.top_k, dim=-1)                          # [T, k]
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts.run(i, x, ids, weights.to(x.dtype))

"""OLMoE: like Qwen3-MoE but its QK-norm spans the whole projection (H*D for q, K*D for
k) before the heads are split, q/k/v may be clipped (clip_qkv), and the router keeps
raw top-k probabilities unless norm_topk_prob.

Legend: T tokens, E hidden, H heads, K kv heads, D head dim, N experts, k top-k.
"""

from __future__ import annotations

import torch

from moefit.kernels import Router
from moefit.models.attention import attend_state
from moefit.models.layers import DecoderModel, Weights, linear, normed_heads, output_weights, rms_norm, softmax_topk
from moefit.models.rope import RopeTable


class Olmoe(DecoderModel):
    graph_step = True        # its attention reads the state only as decode_graphs.BucketView answers

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
            "q_norm": w.get(a + "q_norm.weight"),
            "k_norm": w.get(a + "k_norm.weight"),
            "router": w.router(p + "mlp.gate.weight"),
        }

    def attention(self, i, layer, x, start, cos, sin, mask, kv) -> torch.Tensor:
        c = self.cfg
        t, hd = x.shape[0], c.head_dim
        q, k, v = linear(x, layer["qkv"]).split([c.num_heads * hd, c.num_kv_heads * hd, c.num_kv_heads * hd], -1)
        q, k = rms_norm(q, layer["q_norm"], c.rms_norm_eps), rms_norm(k, layer["k_norm"], c.rms_norm_eps)
        if c.clip_qkv is not None:
            q, k, v = (z.clamp(-c.clip_qkv, c.clip_qkv) for z in (q, k, v))
        q = normed_heads(q.view(t, c.num_heads, hd), None, 0.0, cos, sin)                  # [H, T, D]
        k = normed_heads(k.view(t, c.num_kv_heads, hd), None, 0.0, cos, sin)               # [K, T, D]
        v = v.view(t, c.num_kv_heads, hd).transpose(0, 1)                                # [K, T, D]
        kv.write(i, start, k, v)
        return linear(attend_state(kv, i, q, start, mask), layer["o"])

    def native_router(self, layer) -> Router:
        return Router(layer["router"], None, self.cfg.top_k, self.cfg.norm_topk_prob)  # as route's

    def route(self, i, layer, x) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = softmax_topk(x, layer["router"], self.cfg.top_k, self.cfg.norm_topk_prob)  # [T, k]
        return weights.to(x.dtype), ids

    def mlp(self, i, layer, x, experts, routed=None) -> torch.Tensor:
        return self.routed_experts(i, layer, x, experts, routed)

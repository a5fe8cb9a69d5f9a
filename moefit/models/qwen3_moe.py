"""Qwen3-MoE: GQA attention with per-head RMSNorm on q and k (QK-norm), a softmax
top-k router (renormalised when norm_topk_prob), and dense-MLP layers where
decoder_sparse_step / mlp_only_layers say so.

Legend: T tokens, E hidden, H heads, K kv heads, D head dim, N experts, k top-k.
"""

from __future__ import annotations

import torch

from moefit.kernels import Router
from moefit.models.attention import attend_state
from moefit.models.layers import DecoderModel, Weights, linear, normed_heads, output_weights, softmax_topk, swiglu
from moefit.models.rope import RopeTable


class Qwen3Moe(DecoderModel):
    graph_step = True        # its attention reads the state only as decode_graphs.BucketView answers

    def __init__(self, cfg, w: Weights, rope: RopeTable):
        self.cfg, self.rope = cfg, rope
        self.layers = [self._layer(w, i) for i in range(cfg.num_layers)]
        self.embed, self.norm, self.lm_head = output_weights(cfg, w)

    def _layer(self, w: Weights, i: int) -> dict:
        p = f"model.layers.{i}."
        a = p + "self_attn."
        layer = {
            "input_norm": w.get(p + "input_layernorm.weight"),
            "post_norm": w.get(p + "post_attention_layernorm.weight"),
            "qkv": w.fused([a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"]),
            "o": w.get(a + "o_proj.weight"),
            "q_norm": w.get(a + "q_norm.weight"),
            "k_norm": w.get(a + "k_norm.weight"),
        }
        if w.has(a + "q_proj.bias"):
            layer["qkv_bias"] = w.fused([a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"])
        if i in self.cfg.moe_layers:
            layer["router"] = w.router(p + "mlp.gate.weight")
        else:
            layer["gate_up"] = w.fused([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"])
            layer["down"] = w.get(p + "mlp.down_proj.weight")
        return layer

    def attention(self, i, layer, x, start, cos, sin, mask, kv) -> torch.Tensor:
        step = self.attention_step(i, layer, x, start, cos, sin, mask, kv, layer["q_norm"], layer["k_norm"])
        if step is not None:                                                             # a decode step on the host
            return step
        c = self.cfg
        t, hd = x.shape[0], c.head_dim
        qkv = linear(x, layer["qkv"], layer.get("qkv_bias"))
        q, k, v = qkv.split([c.num_heads * hd, c.num_kv_heads * hd, c.num_kv_heads * hd], dim=-1)
        q = normed_heads(q.view(t, c.num_heads, hd), layer["q_norm"], c.rms_norm_eps, cos, sin)      # [H, T, D]
        k = normed_heads(k.view(t, c.num_kv_heads, hd), layer["k_norm"], c.rms_norm_eps, cos, sin)   # [K, T, D]
        v = v.view(t, c.num_kv_heads, hd).transpose(0, 1)                                          # [K, T, D]
        kv.write(i, start, k, v)
        return linear(attend_state(kv, i, q, start, mask), layer["o"])

    def native_router(self, layer) -> Router:
        return Router(layer["router"], None, self.cfg.top_k, self.cfg.norm_topk_prob)  # as route's

    def route(self, i, layer, x) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = softmax_topk(x, layer["router"], self.cfg.top_k, self.cfg.norm_topk_prob)  # [T, k]
        return weights.to(x.dtype), ids

    def mlp(self, i, layer, x, experts, routed=None) -> torch.Tensor:
        if "router" not in layer:
            return swiglu(x, layer["gate_up"], layer["down"])
        return self.routed_experts(i, layer, x, experts, routed)

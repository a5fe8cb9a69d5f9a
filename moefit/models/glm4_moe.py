"""GLM-4.5 / 4.6 / 4.7 (glm4_moe; declaration in families/glm4_moe.py): GQA with q/k/v biases,
optional per-head QK-norm, RoPE on the first half of each head (partial_rotary_factor); the
first `first_k_dense_replace` layers have a dense SwiGLU MLP, the rest route each token to
top-k experts with DeepSeek-V3's sigmoid, group-limited router and add a shared expert.

Legend: T tokens, E hidden, H heads, K kv heads, D head dim, N experts, k top-k.
"""

from __future__ import annotations

import torch

from moefit.kernels import Router
from moefit.models.attention import attend_state
from moefit.models.layers import DecoderModel, Weights, linear, normed_heads, output_weights, sigmoid_router, swiglu
from moefit.models.rope import RopeTable


class Glm4Moe(DecoderModel):
    graph_step = True        # its attention reads the state only as decode_graphs.BucketView answers

    def __init__(self, cfg, w: Weights, rope: RopeTable):
        self.cfg, self.rope = cfg, rope
        r = cfg.raw
        self.groups, self.top_groups = r.get("n_group") or 1, r.get("topk_group") or 1
        self.scale = float(r.get("routed_scaling_factor") or 1.0)
        self.layers = [self._layer(w, i) for i in range(cfg.num_layers)]
        self.embed, self.norm, self.lm_head = output_weights(cfg, w)

    def _layer(self, w: Weights, i: int, moe: bool | None = None) -> dict:
        p = f"model.layers.{i}."
        return {"input_norm": w.get(p + "input_layernorm.weight"),
                "post_norm": w.get(p + "post_attention_layernorm.weight"),
                **self._attention_weights(w, i), **self._mlp_weights(w, i, moe)}

    def mtp_layer(self, w: Weights, j: int) -> dict:
        """MTP layer j (models/mtp.py): DeepSeek-V3's layout, an MoE decoder layer after the last
        with its input norms, its projection and its output norm."""
        i = self.cfg.num_layers + j
        p = f"model.layers.{i}."
        return {"layer": self._layer(w, i, moe=True), "embed_norm": w.get(p + "enorm.weight"),
                "hidden_norm": w.get(p + "hnorm.weight"), "project": w.get(p + "eh_proj.weight"),
                "out_norm": w.get(p + "shared_head.norm.weight")}

    def _attention_weights(self, w: Weights, i: int) -> dict:
        a = f"model.layers.{i}.self_attn."
        layer = {"qkv": w.fused([a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"]),
                 "o": w.get(a + "o_proj.weight")}
        if w.has(a + "q_proj.bias"):
            layer["qkv_bias"] = w.fused([a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"])
        if w.has(a + "q_norm.weight"):
            layer["q_norm"], layer["k_norm"] = w.get(a + "q_norm.weight"), w.get(a + "k_norm.weight")
        return layer

    def _mlp_weights(self, w: Weights, i: int, moe: bool | None = None) -> dict:
        p = f"model.layers.{i}."
        if not (i in self.cfg.moe_layers if moe is None else moe):
            return {"gate_up": w.fused([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
                    "down": w.get(p + "mlp.down_proj.weight")}
        s = p + "mlp.shared_experts."
        return {"router": w.router(p + "mlp.gate.weight"), "bias": w.get(p + "mlp.gate.e_score_correction_bias"),
                "shared_gate_up": w.fused([s + "gate_proj.weight", s + "up_proj.weight"]),
                "shared_down": w.get(s + "down_proj.weight")}

    def attention(self, i, layer, x, start, cos, sin, mask, kv) -> torch.Tensor:
        step = self.attention_step(i, layer, x, start, cos, sin, mask, kv, layer.get("q_norm"), layer.get("k_norm"))
        if step is not None:
            return step
        c = self.cfg
        t, hd = x.shape[0], c.head_dim
        qkv = linear(x, layer["qkv"], layer.get("qkv_bias"))
        q, k, v = qkv.split([c.num_heads * hd, c.num_kv_heads * hd, c.num_kv_heads * hd], dim=-1)
        q = normed_heads(q.view(t, c.num_heads, hd), layer.get("q_norm"), c.rms_norm_eps, cos, sin)    # [H, T, D]
        k = normed_heads(k.view(t, c.num_kv_heads, hd), layer.get("k_norm"), c.rms_norm_eps, cos, sin) # [K, T, D]
        v = v.view(t, c.num_kv_heads, hd).transpose(0, 1)
        kv.write(i, start, k, v)
        return linear(attend_state(kv, i, q, start, mask), layer["o"])

    def native_router(self, layer) -> Router:
        return Router(layer["router"], layer["bias"], self.cfg.top_k, self.cfg.norm_topk_prob, sigmoid=True,
                      groups=self.groups, top_groups=self.top_groups, scale=self.scale)          # as route's

    def route(self, i, layer, x) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = sigmoid_router(x, layer["router"], layer["bias"], self.cfg.top_k, self.groups,
                                      self.top_groups, self.cfg.norm_topk_prob, self.scale)
        return weights.to(x.dtype), ids

    def mlp(self, i, layer, x, experts, routed=None) -> torch.Tensor:
        if "router" not in layer:
            return swiglu(x, layer["gate_up"], layer["down"])
        moe, shared = self.routed_and_shared(i, layer, x, experts, routed)
        return moe + shared

"""gpt-oss (gpt_oss; declaration in families/gpt_oss.py): GQA with biases everywhere and a
learned attention sink per head (a virtual key with no value that takes part of each softmax),
sliding-window (128) and full attention alternating by `layer_types`; every layer MoE with a
biased router whose top-k logits are softmaxed, and experts with biases and a clamped gate:

    gate, up = x W_gu + b_gu          (the checkpoint interleaves them; the pack splits them)
    h = (clamp(up, -L, L) + 1) * g * sigmoid(alpha g),  g = min(gate, L)      alpha 1.702, L 7
    y = h W_d + b_d

The experts' biases live with the dense weights ([N, 2I] and [N, E] per layer, a few MiB);
the host's native calls take them with the clamped gate (native_act), the device's slot-table
kernels as fused_act, its grouped path as group_act, the torch fallback expert by expert (expert).
Legend: T tokens, E hidden, H heads, K kv heads, D head dim, N experts, I expert size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moefit.models.attention import attend_state
from moefit.models.layers import DecoderModel, Weights, linear, normed_heads, output_weights
from moefit.models.rope import RopeTable
from moefit import kernels
from moefit.experts.grouped import GroupAct
from moefit.kernels import rows as native
from moefit.kernels.device_moe import ClampedAct
from moefit.pack.quant import qlinear


class GptOss(DecoderModel):
    graph_step = True        # its attention (sinks, a sliding layer's ring) reads the state only as BucketView answers

    def __init__(self, cfg, w: Weights, rope: RopeTable):
        self.cfg, self.rope = cfg, rope
        self.alpha, self.limit = float(cfg.raw.get("swiglu_alpha", 1.702)), float(cfg.raw.get("swiglu_limit", 7.0))
        self.host_act: dict[int, kernels.StepAct] = {}       # the native calls', with their fp32 host biases
        self.layers = [self._layer(w, i) for i in range(cfg.num_layers)]
        self.embed, self.norm, self.lm_head = output_weights(cfg, w)

    def _layer(self, w: Weights, i: int) -> dict:
        p, a, e = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp.experts."
        gate_up_bias = w.host(e + "gate_up_proj_bias")                                  # [N, 2I] interleaved
        gate_up_bias = torch.cat([gate_up_bias[:, 0::2], gate_up_bias[:, 1::2]], dim=1).contiguous()
        self.host_act[i] = kernels.StepAct(self.alpha, self.limit, gate_up_bias.float().contiguous(),
                                           w.host(e + "down_proj_bias").float().contiguous())
        return {
            "input_norm": w.get(p + "input_layernorm.weight"),
            "post_norm": w.get(p + "post_attention_layernorm.weight"),
            "qkv": w.fused([a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"]),
            "qkv_bias": w.fused([a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"]),
            "o": w.get(a + "o_proj.weight"), "o_bias": w.get(a + "o_proj.bias"), "sinks": w.get(a + "sinks"),
            "router": w.router(p + "mlp.router.weight"), "router_bias": w.get(p + "mlp.router.bias"),
            "gate_up_bias": w.place(e + "gate_up_proj_bias", gate_up_bias),
            "down_bias": w.get(e + "down_proj_bias"),
        }

    def attention(self, i, layer, x, start, cos, sin, mask, kv) -> torch.Tensor:
        step = self.attention_step(i, layer, x, start, cos, sin, mask, kv, sinks=layer["sinks"])
        if step is not None:                                                             # a decode step on the host
            return step
        c = self.cfg
        t, hd = x.shape[0], c.head_dim
        q, k, v = linear(x, layer["qkv"], layer["qkv_bias"]).split(
            [c.num_heads * hd, c.num_kv_heads * hd, c.num_kv_heads * hd], dim=-1)
        q = normed_heads(q.view(t, c.num_heads, hd), None, 0.0, cos, sin)                  # [H, T, D]
        k = normed_heads(k.view(t, c.num_kv_heads, hd), None, 0.0, cos, sin)
        v = v.view(t, c.num_kv_heads, hd).transpose(0, 1)
        kv.write(i, start, k, v)
        out = attend_state(kv, i, q, start, mask, sinks=layer["sinks"])
        return linear(out, layer["o"], layer["o_bias"])

    def route(self, i, layer, x) -> tuple[torch.Tensor, torch.Tensor]:
        routed = native.softmax_topk(x, layer["router"], self.cfg.top_k, True, layer["router_bias"])
        if routed is None:                           # the softmax of the top-k logits: softmax_topk renormalised
            top, ids = torch.topk(linear(x, layer["router"].to(x.dtype), layer["router_bias"]), self.cfg.top_k, dim=-1)
            routed = F.softmax(top.float(), dim=-1), ids
        weights, ids = routed
        return weights.to(x.dtype), ids

    def mlp(self, i, layer, x, experts, routed=None) -> torch.Tensor:
        return self.routed_experts(i, layer, x, experts, routed)

    def native_act(self, layer: int) -> kernels.StepAct:
        """The native calls' activation for a layer's experts (experts/host_side.py)."""
        return self.host_act[layer]

    def native_router(self, layer: dict) -> kernels.Router:
        """`route` as the native call takes it (a decode step routed with its experts' post)."""
        return kernels.Router(layer["router"], layer["router_bias"], self.cfg.top_k, renorm=True)

    def expert(self, layer: int, e: int, x: torch.Tensor, parts: dict, quant: str, linear=qlinear) -> torch.Tensor:
        """One expert on x [T, E] from its blob parts, with its biases and the clamped gate (linear:
        qlinear, or the runner's fp32 GEMM for a prompt chunk's busy experts)."""
        biases = self.layers[layer]
        gate, up = (linear(x, parts, "gate_up", quant) + biases["gate_up_bias"][e].to(x.device, x.dtype)).chunk(2, -1)
        return linear(self.clamped_glu(gate, up), parts, "down", quant) + biases["down_bias"][e].to(x.device, x.dtype)

    def group_act(self, layer: int, experts: torch.Tensor) -> GroupAct:
        """The grouped device path's expert function for these experts (ids on the device)."""
        biases = self.layers[layer]
        return GroupAct(biases["gate_up_bias"][experts], biases["down_bias"][experts], self.clamped_glu)

    def fused_act(self, layer: int) -> ClampedAct:
        """The slot-table kernels' expert function for a layer (kernels/device_moe.py)."""
        biases = self.layers[layer]
        return ClampedAct(biases["gate_up_bias"].contiguous(), biases["down_bias"].contiguous(), self.alpha, self.limit)

    def clamped_glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """(clamp(up) + 1) * g * sigmoid(alpha g), g = min(gate, limit); gate and up are overwritten."""
        gate, up = gate.clamp_(max=self.limit), up.clamp_(-self.limit, self.limit)
        return torch.sigmoid(gate * self.alpha).mul_(gate).mul_(up.add_(1))

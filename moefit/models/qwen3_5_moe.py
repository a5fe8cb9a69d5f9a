"""Qwen3.5 / Qwen3.6-MoE (qwen3_5_moe; declaration in families/qwen3_5_moe.py): a hybrid
stack, three Gated DeltaNet layers (models/deltanet.py) to one full-attention layer, every
layer MoE with a shared expert behind a sigmoid gate.

    full attention   GQA with a per-head output gate (q_proj gives each head its query and
                     its gate), per-head QK-norm, RoPE on the first quarter of each head
    Gated DeltaNet   one projection to q, k, v (through a causal conv + SiLU), z (the output
                     gate), b (beta) and a (the decay); l2-normed q, k; the delta rule; a gated
                     RMSNorm; out_proj
    MoE              softmax top-k, renormalised; + sigmoid(shared_expert_gate(x)) * shared(x)

Its RMSNorms are zero-centred (x * (1 + w)); the weights are stored as 1 + w at load.
Legend: T tokens, E hidden, H heads, K kv heads, D head dim, Hk / Hv DeltaNet key / value heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moefit.families import qwen3_next as spec
from moefit.kernels import Router, rows as native
from moefit.models import deltanet
from moefit.models.attention import attend_state
from moefit.models.layers import (DecoderModel, QWeight, Weights, linear, made_before, made_once, normed_heads,
                                  rms_norm, softmax_topk)
from moefit.models.rope import RopeTable


class Qwen3_5Moe(DecoderModel):
    graph_step = True        # its attention and DeltaNet read the state only as decode_graphs.BucketView answers

    def __init__(self, cfg, w: Weights, rope: RopeTable):
        self.cfg, self.rope = cfg, rope
        self.dims = spec.linear_dims(cfg)                  # Hk, Hv, Dk, Dv, conv kernel
        self.layers = [self._layer(w, i, kind) for i, kind in enumerate(spec.layer_types(cfg))]
        self.embed = w.host("model.embed_tokens.weight")
        self.norm = w.centred("model.norm.weight")
        self.lm_head = w.get("model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight")
        self.delta_native: dict = {}                      # id(layer dict) -> (it, its native DeltaNet step)

    def _layer(self, w: Weights, i: int, kind: str) -> dict:
        p = f"model.layers.{i}."
        layer = {"input_norm": w.centred(p + "input_layernorm.weight"),
                 "post_norm": w.centred(p + "post_attention_layernorm.weight")}
        if kind == "full_attention":
            a = p + "self_attn."
            layer.update(qkv=w.fused([a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"]),
                         o=w.get(a + "o_proj.weight"), q_norm=w.centred(a + "q_norm.weight"),
                         k_norm=w.centred(a + "k_norm.weight"))
        else:
            a = p + "linear_attn."
            layer.update(linear=True, in_proj=self.in_proj(w, a),
                         conv=w.get(a + "conv1d.weight"), dt_bias=w.get(a + "dt_bias"), a_log=w.get(a + "A_log"),
                         gated_norm=w.get(a + "norm.weight"), out=w.get(a + "out_proj.weight"))
        s = p + "mlp.shared_expert."
        layer.update(router=w.router(p + "mlp.gate.weight"), shared_gate=w.get(p + "mlp.shared_expert_gate.weight"),
                     shared_gate_up=w.fused([s + "gate_proj.weight", s + "up_proj.weight"]),
                     shared_down=w.get(s + "down_proj.weight"))
        return layer

    def mtp_layer(self, w: Weights, j: int) -> dict:
        """MTP layer j (models/mtp.py): a full-attention layer after the last (the pack's name for the
        checkpoint's mtp.layers.j), and mtp.*'s zero-centred norms and projection."""
        return {"layer": self._layer(w, self.cfg.num_layers + j, "full_attention"),
                "embed_norm": w.centred("mtp.pre_fc_norm_embedding.weight"),
                "hidden_norm": w.centred("mtp.pre_fc_norm_hidden.weight"), "project": w.get("mtp.fc.weight"),
                "out_norm": w.centred("mtp.norm.weight")}

    def in_proj(self, w: Weights, a: str):
        """DeltaNet's input projections as one matrix, rows [q | k | v | z | b | a], heads in order."""
        return w.fused([a + n for n in ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight",
                                         "in_proj_a.weight")])

    def attention(self, i, layer, x, start, cos, sin, mask, kv) -> torch.Tensor:
        if "linear" in layer:
            return self.delta_net(i, layer, x, start, kv)
        step = self.attention_step(i, layer, x, start, cos, sin, mask, kv, layer["q_norm"], layer["k_norm"], gated=True)
        if step is not None:                                                             # a decode step on the host
            return step
        c = self.cfg
        t, hd = x.shape[0], c.head_dim
        q_gate, k, v = linear(x, layer["qkv"]).split([2 * c.num_heads * hd, c.num_kv_heads * hd,
                                                      c.num_kv_heads * hd], dim=-1)
        q, gate = q_gate.view(t, c.num_heads, 2 * hd).chunk(2, dim=-1)                  # per head: query, gate
        q = normed_heads(q, layer["q_norm"], c.rms_norm_eps, cos, sin)                    # [H, T, D]
        k = normed_heads(k.view(t, c.num_kv_heads, hd), layer["k_norm"], c.rms_norm_eps, cos, sin)
        v = v.view(t, c.num_kv_heads, hd).transpose(0, 1)
        kv.write(i, start, k, v)
        out = attend_state(kv, i, q, start, mask)                                       # [T, H*D]
        return linear(out * torch.sigmoid(gate.reshape(t, -1)), layer["o"])

    def delta_net(self, i, layer, x, start, kv) -> torch.Tensor:
        state = kv.layers[i]
        state.begin(start, x.shape[0])
        return self.delta_begun(layer, x, state)

    def _block_step(self, i, layer, x, start, cos, sin, mask, kv):
        """A DeltaNet layer's decode step as a block (DecoderModel.attention_block): both norms, the
        residual, in_proj and out_proj in the step's one native call (kernels/delta.h), once
        delta_steps has made the layer's step and it takes them; the same numbers."""
        if "linear" not in layer:
            return super()._block_step(i, layer, x, start, cos, sin, mask, kv)
        step, state = made_before(self.delta_native, layer), kv.layers[i]
        if step is None or not step.blocks or x.shape[0] != 1 or not step.takes(x, state.conv, state.s):
            return None
        state.begin(start, 1)
        out = step.block_run(x, state.conv, state.s)
        if out is None:                        # refused, nothing changed: op by op, the state begun
            eps = self.cfg.rms_norm_eps
            x = x + self.delta_begun(layer, rms_norm(x, layer["input_norm"], eps), state)
            out = x, rms_norm(x, layer["post_norm"], eps)
        return out

    def delta_begun(self, layer, x, state) -> torch.Tensor:
        """The DeltaNet sublayer of x (normed), its state begun for these tokens."""
        proj = linear(x, layer["in_proj"])
        one_by_one = x.shape[0] == 1 or state.saved is not None          # a decode step, a verify window
        o = self.delta_steps(layer, proj, state) if one_by_one else None
        if o is None:
            o = self.delta_ops(layer, proj, state)
        return linear(o.to(x.dtype), layer["out"])

    def delta_ops(self, layer: dict, proj: torch.Tensor, state) -> torch.Tensor:
        """DeltaNet from in_proj's output [T, C + Hv Dv + 2 Hv] to out_proj's input [T, Hv Dv] fp32,
        op by op: the conv, the heads, the recurrence (chunked for a prompt, recurrent for a step or
        a verify window, whose states are kept per position), the gated norm."""
        hk, hv, dk, dv, _ = self.dims
        t = proj.shape[0]
        mixed, z, b, a = proj.split([2 * hk * dk + hv * dv, hv * dv, hv, hv], dim=-1)
        q, k, v = deltanet.causal_conv(mixed, state.conv, layer["conv"]).split([hk * dk, hk * dk, hv * dv], dim=-1)
        # each key head repeated for its value heads (expand + one copy: repeat_interleave was ~4x slower)
        heads = lambda y, n, d: y.view(t, n, 1, d).expand(t, n, hv // n, d).reshape(t, hv, d).transpose(0, 1).float()  # noqa: E731
        q = deltanet.l2norm(heads(q, hk, dk)) * dk ** -0.5                                  # [Hv, T, Dk]
        k = deltanet.l2norm(heads(k, hk, dk))
        beta = b.float().sigmoid().T                                                      # [Hv, T]
        g = (-layer["a_log"].float().exp() * F.softplus(a.float() + layer["dt_bias"])).T  # log decay
        v = heads(v, hv, dv)
        if state.saved is not None:            # a verify window: the recurrent form, the state kept per position
            state.conv_inputs = mixed
            o = deltanet.recurrent(q, k, v, g, beta, state.s, after=state.save)
        else:
            o = (deltanet.chunked if t > 1 else deltanet.recurrent)(q, k, v, g, beta, state.s)
        o = rms_norm(o.transpose(0, 1).to(proj.dtype), layer["gated_norm"], self.cfg.rms_norm_eps)   # [T, Hv, Dv]
        return (o * F.silu(z.view(t, hv, dv).float())).reshape(t, -1)

    def _sublayer(self, layer: dict) -> tuple | None:
        """What a DeltaNet step needs to be a block: both projections bound, both norms, eps."""
        if not (isinstance(layer["in_proj"], QWeight) and isinstance(layer["out"], QWeight)):
            return None
        return layer["in_proj"].step, layer["out"].step, layer["input_norm"], layer["post_norm"], self.cfg.rms_norm_eps

    def delta_steps(self, layer: dict, proj: torch.Tensor, state) -> torch.Tensor | None:
        """DeltaNet from in_proj's output to out_proj's input a token at a time, each one native
        call (kernels/delta.h) that updates the layer's conv window and state: a decode step, or a
        verify window (its state kept after each position but the last, its conv inputs kept).
        None where the call does not apply (not fp32 on the host), and delta_net goes op by op."""
        step = made_once(self.delta_native, layer, lambda: native.DeltaStep(
            self.dims, layer["conv"], layer["a_log"], layer["dt_bias"], layer["gated_norm"], self.cfg.rms_norm_eps,
            self._sublayer(layer)))
        if not step.takes(proj, state.conv, state.s):
            return None
        out = []
        for t in range(proj.shape[0]):
            if t > 0:
                state.save(t - 1)
            out.append(step.run(proj[t:t + 1], state.conv, state.s))
        if state.saved is not None:
            hk, hv, dk, dv, _ = self.dims
            state.conv_inputs = proj[:, :2 * hk * dk + hv * dv]
        return torch.cat(out)

    def native_router(self, layer) -> Router:
        return Router(layer["router"], None, self.cfg.top_k, True)  # as route's

    def route(self, i, layer, x) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = softmax_topk(x, layer["router"], self.cfg.top_k, renorm=True)        # [T, k]
        return weights.to(x.dtype), ids

    def mlp(self, i, layer, x, experts, routed=None) -> torch.Tensor:
        moe, shared = self.routed_and_shared(i, layer, x, experts, routed)
        return moe + torch.sigmoid(linear(x, layer["shared_gate"])) * shared

"""DeepSeek-V3 and Kimi-K2 (deepseek_v3; declaration in families/deepseek_v3.py): multi-head
latent attention (MLA) and DeepSeek's MoE.

MLA (DeepSeek-V2, 2024) keeps per token only c, the RMS-normed latent [r] of kv_a_proj, and one
rope key k_r [dr] shared by all heads; kv_b_proj expands c into each head's nope key and value.
Attention is computed in the latent space ("absorbed"): each head's nope query is taken
through its slice of kv_b_proj (q_c = q_nope W_uk), so

    score = q_c . c + q_r . k_r        out = (P c) W_uv^T

which is one-kv-head attention over [c, k_r] with values c: the stored latent is never
expanded to H heads (a decode step reads it as stored: attention.attend_latent, kernels/kv.h).
Under --dense-quant the two per-head products are quantised too: each head's W_uk^T [r, dn]
and W_uv [dv, r], stacked, multiplied head by head in one native call (kernels.linear_heads),
where kv_b's slices would stay in the compute dtype (families/deepseek_v3.per_head). Queries go
through the low-rank q_a / q_b pair when q_lora_rank is set;
RoPE pairs channels (x0, x1), ... (rope_interleave); the softmax scale is (dn + dr)^-1/2,
times YaRN's mscale^2 when the RoPE is scaled.

The MoE is GLM-4.5's (sigmoid, group-limited, shared experts): `first_k_dense_replace` dense
layers first. Legend: T tokens, E hidden, H heads, r latent rank, dn / dr nope / rope dims, dv
value head dim.
"""

from __future__ import annotations

import torch

from moefit import kernels
from moefit.families.deepseek_v3 import KV_B_VALUES, dims, per_head
from moefit.kernels.latent import LatentStep
from moefit.models.glm4_moe import Glm4Moe
from moefit.models.attention import attend_latent, attend_state, turn
from moefit.models.layers import QWeight, Weights, linear, made_before, rms_norm
from moefit.models.rope import RopeTable, apply_rope, apply_rope_interleaved, yarn_mscale
from moefit.pack.quant import dequantize


class DeepseekV3(Glm4Moe):
    def __init__(self, cfg, w: Weights, rope: RopeTable):
        self.rank, self.dr, self.dn, self.dv, self.q_rank = dims(cfg)
        self.softmax_scale = (self.dn + self.dr) ** -0.5 * _yarn_mscale_squared(cfg.rope)
        self.rotate = apply_rope_interleaved if cfg.raw.get("rope_interleave", True) else apply_rope
        super().__init__(cfg, w, rope)

    def _attention_weights(self, w: Weights, i: int) -> dict:
        a, h = f"model.layers.{i}.self_attn.", self.cfg.num_heads
        kv_b = w.host(a + "kv_b_proj.weight").view(h, self.dn + self.dv, self.rank)
        q, o = a + ("q_b_proj.weight" if self.q_rank else "q_proj.weight"), a + "o_proj.weight"
        layer = {"kv_a": w.get(a + "kv_a_proj_with_mqa.weight"), "kv_norm": w.get(a + "kv_a_layernorm.weight"),
                 "q": w.get(q), "o": w.get(o)}
        if self.q_rank:
            layer.update(q_a=w.get(a + "q_a_proj.weight"), q_norm=w.get(a + "q_a_layernorm.weight"))
        if per_head(self.cfg, w.dense_quant):                 # quantised, head by head (families/deepseek_v3.py)
            return layer | {
                "w_uk": w.derived(a + "kv_b_proj.weight", kv_b[:, :self.dn].transpose(1, 2).reshape(h * self.rank, -1)),
                "w_uv": w.derived(a + "kv_b_proj.weight" + KV_B_VALUES, kv_b[:, self.dn:].reshape(h * self.dv, -1))}
        return layer | {"w_uk": w.place(a + "kv_b_proj.weight", kv_b[:, :self.dn].transpose(1, 2).contiguous()),
                        "w_uv": w.place(a + "kv_b_proj.weight", kv_b[:, self.dn:].contiguous())}     # [H, r, dn], [H, dv, r]

    def attention(self, i, layer, x, start, cos, sin, mask, kv) -> torch.Tensor:
        step = self.latent_step(layer, x, start, cos, sin, mask, kv.writable_rows(i))
        if step is not None:                                                            # a decode step on the host
            return linear(step, layer["o"])
        c, t = self.cfg, x.shape[0]
        q_in = rms_norm(linear(x, layer["q_a"]), layer["q_norm"], c.rms_norm_eps) if self.q_rank else x
        q = linear(q_in, layer["q"]).view(t, c.num_heads, self.dn + self.dr).transpose(0, 1)
        q_nope, q_rope = q.split([self.dn, self.dr], -1)                               # [H, T, dn], [H, T, dr]
        q_latent = self.through_heads(q_nope, layer["w_uk"])                           # [H, T, r]
        latent, k_rope = linear(x, layer["kv_a"]).split([self.rank, self.dr], dim=-1)
        latent = rms_norm(latent, layer["kv_norm"], c.rms_norm_eps)
        kv.write(i, start, self.rotate(k_rope[None], cos, sin), latent[None])          # one "head": [1, T, .]
        rk, rv = kv.rotations(i)                     # q4 rows: rope keys and latents each turned (kv_codecs)
        q_abs = torch.cat((_turned(q_latent, rv), _turned(self.rotate(q_rope, cos, sin), rk)), dim=-1)
        out = attend_latent(kv, i, q_abs, start, self.softmax_scale)                  # [T, H*r]
        if out is None:
            out = attend_state(kv, i, q_abs, start, mask, scale=self.softmax_scale, turned=False,
                               keys=lambda k_r, c_kv: (torch.cat((c_kv, k_r), dim=-1), c_kv))
        out = out.view(t, c.num_heads, self.rank).transpose(0, 1)                      # [H, T, r]
        if rv is not None:                           # the values were turned latents: turn the output back
            out = _turned(out, rv, back=True)
        out = self.through_heads(out, layer["w_uv"])                                   # [H, T, dv]
        return linear(out.transpose(0, 1).reshape(t, -1), layer["o"])

    def through_heads(self, x: torch.Tensor, w) -> torch.Tensor:
        """x [H, T, n] through each head's matrix [m, n] -> [H, T, m]: W_uk^T (m = r) or W_uv (m = dv),
        quantised stacks [H m, n] in one native call, else the compute-dtype slices [H, m, n]."""
        if not isinstance(w, QWeight):
            return x @ w.transpose(1, 2)
        y = kernels.linear_heads(x.float().contiguous(), w.step, self.cfg.num_heads)
        if y is None:                                 # no native library: the stacks dequantised
            y = x.float() @ _dequantized(w).view(self.cfg.num_heads, -1, x.shape[-1]).transpose(1, 2)
        return y.to(x.dtype)

    def latent_step(self, layer, x, start, cos, sin, mask, rows) -> torch.Tensor | None:
        """The layer's attention for one token in one native call (kernels/mla.h): [1, H*dv] before
        o_proj, its rope key and latent written to rows (the state's, where a native step may write
        them); None where it does not apply (more tokens, a mask, kv_b not quantised, a card's or a
        ring's rows, fp16 / bf16 rows), and the layer is computed op by op."""
        if x.shape[0] != 1 or mask is not None or not isinstance(layer["w_uk"], QWeight) or rows is None:
            return None
        step = self.native_step(layer, lambda: LatentStep(
            layer.get("q_a"), layer["q"], layer["kv_a"], layer["w_uk"], layer["w_uv"], layer.get("q_norm"),
            layer["kv_norm"], self.cfg.num_heads, (self.rank, self.dr, self.dn, self.dv), self.cfg.rms_norm_eps,
            self.softmax_scale, self.rotate is apply_rope_interleaved,
            (layer["o"], layer["input_norm"], layer["post_norm"]) if isinstance(layer["o"], QWeight) else None))
        return step(x, start, cos, sin, *rows)

    def _block_step(self, i, layer, x, start, cos, sin, mask, kv):
        """An MLA layer's decode step as a block (DecoderModel.attention_block): both norms, o_proj
        and the residual in the step's one native call (kernels/mla.h), once latent_step has made
        the layer's step and it takes them; the same numbers."""
        step = made_before(self.steps, layer)
        if not getattr(step, "blocks", False) or x.shape[0] != 1 or mask is not None:
            return None
        rows = kv.writable_rows(i)
        return step(x, start, cos, sin, *rows, block=True) if rows is not None else None


def _dequantized(w: QWeight) -> torch.Tensor:
    native = kernels.dequantize(w.parts, "w", w.quant)
    return native if native is not None else dequantize(w.parts, "w", w.quant, torch.float32)


def _turned(x: torch.Tensor, rotation: torch.Tensor | None, back: bool = False) -> torch.Tensor:
    """A query part in its stored rows' rotated space: (x R) . (y R) = x . y for orthonormal R (back:
    an output turned back, x R^T). A decode step's through the native step's loop (as mla.h turns)."""
    return x if rotation is None else turn(x, rotation, back)


def _yarn_mscale_squared(rope: dict) -> float:
    """DeepSeek scales the softmax by mscale(factor, mscale_all_dim)^2 under YaRN."""
    if rope.get("rope_type", "default") == "default" or not rope.get("mscale_all_dim"):
        return 1.0
    return yarn_mscale(rope["factor"], rope["mscale_all_dim"]) ** 2

"""Primitives every family shares: RMSNorm, the routers, the SwiGLU MLP, the quantised dense
matrices, and the residual stack (RoPE: models/rope.py).

Legend: T tokens in this forward, S keys attended (start + T), H query heads,
K key/value heads, D head dim, E hidden size.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from moefit import kernels
from moefit.kernels import rows as native
from moefit.models.attention import causal_mask
from moefit.models.rope import apply_partial_rope
from moefit.pack.layout import DENSE_GROUP, dense_quantizable
from moefit.pack.quant import prompt_sized, qlinear, quantize


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in fp32, as the reference computes it, then scaled in x's dtype. All fp32 (the
    host's compute dtype): one operation, native on the host (a decode token runs ~50 of these)."""
    if x.dtype == weight.dtype == torch.float32:
        y = native.rms_norm(x, weight, eps)
        return y if y is not None else F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def normed_heads(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
                 sin: torch.Tensor) -> torch.Tensor:
    """A projection's heads x [T, H, D] -> [H, T, D], each RMS-normed by weight [D] when given
    (QK-norm) and rotated on its first cos.shape[-1] channels (rotate-half RoPE); on the host one
    native call for all heads."""
    y = native.head_rows(x, weight, eps, cos, sin) if weight is None or x.dtype == weight.dtype else None
    if y is not None:
        return y
    return apply_partial_rope((rms_norm(x, weight, eps) if weight is not None else x).transpose(0, 1), cos, sin)


def softmax_topk(x: torch.Tensor, router: torch.Tensor, top_k: int, renorm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The softmax router (Qwen3-MoE, Qwen3.5 / Next, Mixtral, OLMoE): the top_k most probable
    experts of softmax(x . router^T) in fp32, their probabilities divided by their sum when renorm.
    x [T, E] -> (weights [T, k], ids [T, k]); on the host one native call."""
    routed = native.softmax_topk(x, router, top_k, renorm)
    if routed is not None:
        return routed
    weights, ids = torch.topk(F.softmax(F.linear(x, router.to(x.dtype)).float(), dim=-1), top_k, dim=-1)
    return (weights / weights.sum(dim=-1, keepdim=True) if renorm else weights), ids


def sigmoid_router(x: torch.Tensor, router: torch.Tensor, bias: torch.Tensor, top_k: int, groups: int,
                   top_groups: int, normalise: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """sigmoid_group_topk of x [T, E] through the router [N, E] in fp32: on the host one native call."""
    routed = native.sigmoid_topk(x, router, bias, top_k, groups, top_groups, normalise, scale)
    if routed is not None:
        return routed
    logits = F.linear(x.float(), router.float())                                     # [T, N]
    return sigmoid_group_topk(logits, bias, top_k, groups, top_groups, normalise, scale)


def sigmoid_group_topk(logits: torch.Tensor, bias: torch.Tensor, top_k: int, groups: int, top_groups: int,
                       normalise: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's router (GLM-4.5 too): sigmoid scores; the choice adds a per-expert bias
    (e_score_correction_bias, load balancing) and keeps the `top_groups` groups whose two best
    biased scores sum highest; the weights are the unbiased scores of the chosen, renormalised
    and scaled. logits [T, N] fp32 -> (weights [T, k], ids [T, k])."""
    scores = logits.sigmoid()
    choice = scores + bias.float()
    if top_groups >= groups:                   # every group kept (GLM-4.5, GLM-4.7-Flash: one group): no mask
        ids = choice.topk(top_k, dim=-1).indices
    else:
        ids = choice.masked_fill(~_kept_groups(choice, groups, top_groups), float("-inf")).topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if normalise:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale, ids


def _kept_groups(choice: torch.Tensor, groups: int, top_groups: int) -> torch.Tensor:
    """[T, N] True where an expert's group is among the `top_groups` whose two best scores sum highest."""
    t, n = choice.shape
    group_best = choice.view(t, groups, n // groups).topk(2, dim=-1).values.sum(dim=-1)       # [T, G]
    keep = torch.zeros_like(group_best).scatter_(1, group_best.topk(top_groups, dim=-1).indices, 1.0)
    return keep.bool().repeat_interleave(n // groups, dim=1)


class DecoderModel:
    """What every family's model shares: the residual stack (decoder_stack, which calls the
    family's attention and mlp) and the lm_head. `probes` (layer -> [N, E]) replace the routers
    in the look-ahead's guess where the pack has a trained probe (experts/probe.py); `probe_fit`
    records the probe's training pairs while `moefit profile --probe` runs."""

    probes: dict = {}
    probe_fit = None
    steps: dict | None = None               # id(layer dict) -> (it, its native decode-step attention)
    graph_step = False                      # attention recordable for a bucket (runtime/decode_graphs.py)
    native_router = None                    # a family's layer -> kernels.Router, where `route` is just that
    routers: dict | None = None             # id(layer dict) -> (it, its kernels.Router)

    def forward(self, tokens: torch.Tensor, start: int, kv, experts) -> torch.Tensor:
        """Final hidden states [T, E] for tokens at positions start..start+T."""
        return decoder_stack(self, tokens, start, kv, experts)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return linear(h, self.lm_head).float()                                        # [T, V]

    def attention_step(self, i: int, layer: dict, x: torch.Tensor, start: int, cos: torch.Tensor, sin: torch.Tensor,
                       mask: torch.Tensor | None, kv, q_norm: torch.Tensor | None = None,
                       k_norm: torch.Tensor | None = None, gated: bool = False,
                       sinks: torch.Tensor | None = None) -> torch.Tensor | None:
        """A GQA layer's attention for one token in one native call (kernels/step.h): the
        sublayer's output [1, E], through the output projection (layer's "o", "o_bias"), its key and
        value written to the cache; None where it does not apply (more tokens, the model's mask, not
        the host, a quantised cache, a ring missing a position, a qkv not quantised by
        --dense-quant), and the family computes it op by op. The projection is in the call where
        it is quantised too, else applied here. gated: Qwen3.5's per-head output gate, after each
        head's query in the projection; sinks: gpt-oss's (each applied here). A layer's own window
        or ring (gpt-oss's sliding layers) is read as the state gives it (step_rows)."""
        if x.shape[0] != 1 or mask is not None or not isinstance(layer["qkv"], QWeight):
            return None
        rows = kv.step_rows(i, start)
        if rows is None:
            return None
        c, o, o_bias = self.cfg, layer["o"], layer.get("o_bias")
        step = self.native_step(layer, lambda: native.AttentionStep(
            layer["qkv"].parts, layer["qkv"].quant, c.num_heads, c.num_kv_heads, c.head_dim, layer.get("qkv_bias"),
            q_norm, k_norm, c.rms_norm_eps, gated, sinks, o.step if isinstance(o, QWeight) else None, o_bias,
            (layer["input_norm"], layer["post_norm"])))
        out = step(x, cos, sin, rows)
        if out is None:
            return None
        kv.stepped(i, start)
        return out if step.projects else linear(out, o, o_bias)

    def attention_block(self, i: int, layer: dict, x: torch.Tensor, start: int, cos: torch.Tensor,
                        sin: torch.Tensor, mask: torch.Tensor | None, kv) -> tuple[torch.Tensor, torch.Tensor]:
        """x + attention(input_norm(x)), and that sum's post-attention norm: the family's attention
        between the two norms, or, for a decode step on the host once the family's attention has
        made the layer's native step (attention_step) and it takes them, that one call with both
        norms and the residual in it (kernels/step.h). The same numbers either way."""
        out = self._block_step(i, layer, x, start, cos, sin, mask, kv)
        if out is not None:
            return out
        eps = self.cfg.rms_norm_eps
        x = x + self.attention(i, layer, rms_norm(x, layer["input_norm"], eps), start, cos, sin, mask, kv)
        return x, rms_norm(x, layer["post_norm"], eps)

    def _block_step(self, i: int, layer: dict, x: torch.Tensor, start: int, cos: torch.Tensor, sin: torch.Tensor,
                    mask: torch.Tensor | None, kv) -> tuple[torch.Tensor, torch.Tensor] | None:
        """attention_block's one call, or None (the layer's GQA step not made yet, or not a block).
        A family whose layers have another step answers for them here (Qwen3.5's DeltaNet, MLA)."""
        step = made_before(self.steps, layer)
        if not (isinstance(step, native.AttentionStep) and step.blocks) or x.shape[0] != 1 or mask is not None:
            return None
        rows = kv.step_rows(i, start)
        out = step(x, cos, sin, rows, block=True) if rows is not None else None
        if out is not None:
            kv.stepped(i, start)
        return out

    def routed_experts(self, i: int, layer: dict, x: torch.Tensor, experts, routed=None) -> torch.Tensor:
        """The routed experts' sum for x: the family's router (`route`) or its output given
        (a recorded piece's: runtime/decode_graphs.py), then the runner; where the family's router
        is one of the native ones (`native_router`: softmax_topk's, sigmoid_router's), a decode step
        on host memory routed and its experts posted in one native call (the runner's run_routed;
        the router's numbers)."""
        if routed is None and self.native_router is not None:
            out = experts.run_routed(i, x, self._kept("routers", layer, lambda: self.native_router(layer)))
            if out is not None:
                return out
        weights, ids = routed or self.route(i, layer, x)
        return experts.run(i, x, ids, weights)

    def routed_and_shared(self, i: int, layer: dict, x: torch.Tensor, experts, routed=None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """The routed experts' sum for x and the shared expert's output (layer's shared_gate_up and
        shared_down): the router first (a pooled native call would wait for a posted one), then
        the shared expert started (swiglu_later), then the runner, whose Python before its own
        call runs beside it. A decode step on the host whose router is in the routed experts' one
        call (routed_experts) starts the shared expert first: that call joins it, as a post does."""
        if routed is None and self.native_router is not None and x.shape[0] == 1 and x.is_cpu:
            shared = swiglu_later(x, layer["shared_gate_up"], layer["shared_down"])
            return self.routed_experts(i, layer, x, experts), shared()
        weights, ids = routed or self.route(i, layer, x)
        shared = swiglu_later(x, layer["shared_gate_up"], layer["shared_down"])
        return experts.run(i, x, ids, weights), shared()

    def native_step(self, layer: dict, make):
        """The layer's native decode step (kernels/step.h, mla.h), made by make() on first use."""
        return self._kept("steps", layer, make)

    def _kept(self, cache: str, layer: dict, make):
        """made_once in this model's dict `cache` (steps, routers), made at its first use."""
        if getattr(self, cache) is None:
            setattr(self, cache, {})
        return made_once(getattr(self, cache), layer, make)


def made_once(cache: dict, layer: dict, make):
    """What make() builds for a layer's weights (a native step), built once and kept in cache by
    the weights, not the index: an MTP layer is "layer 0" too. Entries are (layer, it)."""
    if kernels.host_calls_are_off():          # made now it would never call the host: not kept
        return make()
    made = cache.get(id(layer))
    if made is None or made[0] is not layer:
        made = cache[id(layer)] = (layer, make())
    return made[1]


def made_before(cache: dict | None, layer: dict):
    """What made_once built for the layer's weights, or None: not made yet, or host calls are off
    on this thread (a recorded piece: what made_once makes then is not kept either)."""
    if not cache or kernels.host_calls_are_off():
        return None
    made = cache.get(id(layer))
    return made[1] if made is not None and made[0] is layer else None


def decoder_stack(model, tokens: torch.Tensor, start: int, kv, experts) -> torch.Tensor:
    """The residual stack every family shares, one line per sublayer: x = x + attention(norm(x))
    with h = norm(x) after it (attention_block); x = x + mlp(h). Returns final-normed hidden [T, E]."""
    cfg = model.cfg
    x = model.embed[tokens].to(device=model.norm.device, dtype=model.norm.dtype)       # [T, E]
    t = x.shape[0]
    cos, sin = model.rope.rows(start, t)
    mask = causal_mask(start, t, cfg.sliding_window, x.device)
    for i, layer in enumerate(model.layers):
        x, h = model.attention_block(i, layer, x, start, cos, sin, mask, kv)
        if experts.look_ahead and i + 1 < len(model.layers) and "router" in model.layers[i + 1]:
            experts.expect(i + 1, next_layer_guess(model, i + 1, x), "router" in layer)
        if model.probe_fit is not None:
            model.probe_fit.see(model, i, x, h)
        x = x + model.mlp(i, layer, h, experts)
    return rms_norm(x, model.norm, cfg.rms_norm_eps)


GUESS_RANKS = 2          # a guess ranks 2k experts: the first k are the prediction, the rest a spare budget's


def next_layer_guess(model, j: int, h: torch.Tensor) -> torch.Tensor:
    """Layer j's most likely experts as its own norm and router see h, the residual stream before
    layer j-1's MoE: [T, 2k], most likely first, read by the layer's trained probe where the pack
    has one. Softmax is monotonic, so the logits' ranking is every family's."""
    nxt = model.layers[j]
    read = model.probes.get(j, nxt["router"])
    logits = F.linear(rms_norm(h, nxt["post_norm"], model.cfg.rms_norm_eps), read.to(h.dtype))   # [T, N]
    return torch.topk(logits, min(GUESS_RANKS * model.cfg.top_k, logits.shape[-1]), dim=-1).indices


def output_weights(cfg, w: "Weights") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(embedding table on the host, final norm, lm_head) on the device; tied models reuse the table."""
    lm_head = w.get("model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight")
    return w.host("model.embed_tokens.weight"), w.get("model.norm.weight"), lm_head


def swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """Dense SwiGLU MLP with gate and up fused: gate_up [2I, E], down [E, I]; a decode step's
    through two quantised host matrices is one native call (kernels/linear.h)."""
    if _one_call(x, gate_up, down):
        y = kernels.swiglu(x, gate_up.step, down.step)
        if y is not None:
            return y
    return _swiglu_ops(x, gate_up, down)


def swiglu_later(x: torch.Tensor, gate_up, down) -> Callable[[], torch.Tensor]:
    """swiglu(x, gate_up, down) as a function giving it: where it is one native call, that call is
    posted to the kernel pool now (kernels.swiglu_post; a decode step's shared expert, running
    while the runner prepares the routed experts' call), else it is computed now. The same numbers."""
    if _one_call(x, gate_up, down) and kernels.swiglu_takes(x, gate_up.step, down.step):
        call = kernels.swiglu_post(x, gate_up.step, down.step)
        return lambda: y if (y := call.result()) is not None else _swiglu_ops(x, gate_up, down)
    y = swiglu(x, gate_up, down)
    return lambda: y


def _one_call(x: torch.Tensor, gate_up, down) -> bool:
    return isinstance(gate_up, QWeight) and isinstance(down, QWeight) and not prompt_sized(x.shape[0])


def _swiglu_ops(x: torch.Tensor, gate_up, down) -> torch.Tensor:
    gate, up = linear(x, gate_up).chunk(2, dim=-1)
    return linear(F.silu(gate) * up, down)


class QWeight:
    """A dense matrix quantised at load (--dense-quant): int8 codes + a scale per row, or int4
    codes + an fp16 scale per row and group of 32 inputs (the expert blobs' layouts)."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, quant: str):
        self.parts, self.quant = {"w": codes, "w.scale": scale}, quant
        self.step = kernels.BoundMatrix(self.parts, "w", quant)     # a decode step's product, bound once

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, C] @ W^T: a decode step's rows through the bound call, the rest through qlinear."""
        y = None if prompt_sized(x.shape[0]) else self.step(x)
        return y if y is not None else qlinear(x, self.parts, "w", self.quant)

    @property
    def device(self):
        return self.parts["w"].device


def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for a plain weight or a QWeight."""
    if isinstance(w, QWeight):
        y = w(x)
        return y + bias if bias is not None else y
    return F.linear(x, w, bias)


class Weights:
    """Named dense tensors placed on the device. `place(name, tensor)` copies a host
    tensor (a view of the pack) to the device and charges the ledger's dense line."""

    def __init__(self, names: list[str], load, place, dense_quant: str = "off", narrow_routers: bool = False):
        self._load, self._place, self._names = load, place, set(names)
        self.dense_quant, self.narrow_routers = dense_quant, narrow_routers

    def has(self, name: str) -> bool:
        return name in self._names

    def _placed(self, name: str, t: torch.Tensor):
        if self.dense_quant != "off" and dense_quantizable(name, tuple(t.shape), self.dense_quant):
            codes, scale = quantize(t, self.dense_quant, DENSE_GROUP)
            quant = self.dense_quant
            if quant == "int4" and kernels.int4_panels():         # stored as the kernel reads it (kernels/panels.h)
                (codes, scale), quant = kernels.rows_to_panels(codes, scale), "int4p"
            return QWeight(self._place(name, codes), self._place(name + ".scale", scale, keep=True), quant)
        return self._place(name, t)

    def get(self, name: str):
        return self._placed(name, self._load(name))

    def router(self, name: str):
        """A router's matrix, placed as get() places it; where narrow_routers (the host computing in
        fp32) and every value is a bf16 (a bf16 checkpoint's, also once a GGUF file widened it to
        fp32), held in bf16: half the bytes a decode step reads for it (Qwen3.6's 256 x 2048 is 2 MiB
        a layer in fp32, ~12 % of what its MoE reads), the same logits (the native routers widen
        each value as they read it; torch's paths widen the matrix)."""
        t = self._load(name)
        if self.narrow_routers and t.is_floating_point():
            narrow = t.to(torch.bfloat16)
            if torch.equal(narrow.to(t.dtype), t):
                return self._place(name, narrow, keep=True)
        return self._placed(name, t)

    def derived(self, name: str, t: torch.Tensor):
        """A matrix computed from the checkpoint's (MLA's absorbed projections), placed as get()
        places the checkpoint's own: quantised under --dense-quant."""
        return self._placed(name, t)

    def place(self, name: str, t: torch.Tensor):
        """A tensor derived from the checkpoint's (a slice, a reshape), placed as it is."""
        return self._place(name, t)

    def centred(self, name: str):
        """A zero-centred RMSNorm weight (Qwen3.5: x * (1 + w)), stored as 1 + w."""
        return self._place(name, self._load(name).float() + 1.0)

    def host(self, name: str) -> torch.Tensor:
        """A tensor kept in host memory (the embedding table: only looked up)."""
        return self._load(name)

    def fused(self, names: list[str], reorder=None):
        """Several matrices concatenated on dim 0 (q, k, v -> qkv) in one device tensor;
        `reorder` rearranges the rows first (a family whose checkpoint interleaves them)."""
        t = torch.cat([self._load(n) for n in names], dim=0)
        return self._placed(names[0], reorder(t) if reorder else t)

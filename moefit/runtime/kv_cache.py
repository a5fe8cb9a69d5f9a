"""Static KV cache written by absolute position (gpt-fast style): rejecting tokens, or
reusing a prompt prefix, needs no code; later writes overwrite the slots.

Per layer: k, v [K, C, D] (K kv heads, C context). int8 stores codes plus one fp32 scale
per (head, position): [K, C, 1].
"""

from __future__ import annotations

import torch

from moefit.config import ModelConfig
from moefit.runtime.placement import DeviceMemory

KV_TORCH = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "int8": torch.int8}
LINE = "sequence state"


def kv_bytes_per_token(model: ModelConfig, kv_dtype: str) -> int:
    """Bytes one token of context costs, all layers, k and v (the ledger uses this)."""
    per_head = model.head_dim * (1 if kv_dtype == "int8" else KV_TORCH[kv_dtype].itemsize)
    if kv_dtype == "int8":
        per_head += 4                                   # the fp32 scale
    return model.num_layers * 2 * model.num_kv_heads * per_head


class KVCache:
    def __init__(self, model: ModelConfig, ctx: int, kv_dtype: str, compute_dtype: torch.dtype,
                 mem: DeviceMemory):
        self.ctx = ctx
        self.kv_dtype = kv_dtype
        self.compute_dtype = compute_dtype
        shape = (model.num_kv_heads, ctx, model.head_dim)
        store = KV_TORCH[kv_dtype]
        self.k = [mem.empty(LINE, shape, store) for _ in range(model.num_layers)]
        self.v = [mem.empty(LINE, shape, store) for _ in range(model.num_layers)]
        if kv_dtype == "int8":
            scale_shape = (model.num_kv_heads, ctx, 1)
            self.k_scale = [mem.empty(LINE, scale_shape, torch.float32) for _ in range(model.num_layers)]
            self.v_scale = [mem.empty(LINE, scale_shape, torch.float32) for _ in range(model.num_layers)]

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [K, T, D] for positions start..start+T."""
        end = start + k.shape[1]
        if self.kv_dtype != "int8":
            self.k[layer][:, start:end] = k
            self.v[layer][:, start:end] = v
            return
        for codes, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            scale = x.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-8) / 127.0   # [K, T, 1]
            codes[layer][:, start:end] = torch.round(x.float() / scale).clamp(-127, 127).to(torch.int8)
            scales[layer][:, start:end] = scale

    def read(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [K, end, D] in the compute dtype."""
        if self.kv_dtype != "int8":
            return self.k[layer][:, :end].to(self.compute_dtype), self.v[layer][:, :end].to(self.compute_dtype)
        k = self.k[layer][:, :end].to(self.compute_dtype) * self.k_scale[layer][:, :end].to(self.compute_dtype)
        v = self.v[layer][:, :end].to(self.compute_dtype) * self.v_scale[layer][:, :end].to(self.compute_dtype)
        return k, v

"""Byte layout of an expert blob, per quantization. Pure Python: the planner sizes
the expert cache from these numbers without a pack and without torch.

One blob holds one (layer, expert): gate and up fused as gate_up [2I, H], down [H, I],
and their scales, each part aligned to PART_ALIGN bytes inside the blob.

    fp32 / fp16 / bf16   gate_up, down in that dtype
    int8                 per-output-channel symmetric: int8 codes + one fp32 scale per row
    int4                 group-wise symmetric: two 4-bit codes per byte + one fp16 scale
                         per (row, group of `group_size` inputs)
    q8_0                 group-wise symmetric: int8 codes + one fp16 scale per (row, 32 inputs):
                         llama.cpp's Q8_0, so a GGUF file's Q8_0 experts are packed as they are
    q4_k q5_k q6_k       a GGUF file's blocks as the file stores them (super-blocks of 256 weights;
    iq4_xs mxfp4         MXFP4: 32), scales inside (kernels/kquants.h): kept, never made by moefit
    GU/DN                gate_up in GU, down in DN (a GGUF file's Q4_K_M mixes Q4_K and Q6_K)
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

PART_ALIGN = 64
BLOB_ALIGN = 4096
FLOAT_QUANTS = ("fp32", "fp16", "bf16")
QUANTS = FLOAT_QUANTS + ("int8", "int4", "q8_0")
Q8_0_GROUP = 32
RECIPES = QUANTS + ("mixed",)
# GGUF block types kept as they are: (weights, bytes) a block
GGUF_BLOCKS = {"q4_k": (256, 144), "q5_k": (256, 176), "q6_k": (256, 210), "iq4_xs": (256, 136), "mxfp4": (32, 17)}
GGUF_HALVES = {"q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,), "iq4_xs": (0,)}   # a super-block's fp16 scales: byte offsets
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1, "uint8": 1}


@dataclass(frozen=True)
class Part:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int           # inside the blob

    @property
    def nbytes(self) -> int:
        n = DTYPE_BYTES[self.dtype]
        for d in self.shape:
            n *= d
        return n


def align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def matrix_parts(name: str, rows: int, cols: int, quant: str, group: int) -> list[tuple[str, str, tuple]]:
    """(part name, dtype, shape) of one weight matrix [rows, cols] in `quant`."""
    if quant in FLOAT_QUANTS:
        return [(name, quant, (rows, cols))]
    if quant == "int8":
        return [(name, "int8", (rows, cols)), (name + ".scale", "fp32", (rows,))]
    if quant == "int4":
        return [(name, "uint8", (rows, cols // 2)), (name + ".scale", "fp16", (rows, cols // group))]
    if quant == "q8_0":
        return [(name, "int8", (rows, cols)), (name + ".scale", "fp16", (rows, cols // Q8_0_GROUP))]
    if quant in GGUF_BLOCKS:
        weights, size = GGUF_BLOCKS[quant]
        if cols % weights:
            raise ValueError(f"{quant} needs rows of a multiple of {weights} weights, not {cols}")
        return [(name, "uint8", (rows, cols // weights * size))]
    raise ValueError(f"unknown quantization {quant!r}")


@lru_cache(maxsize=None)
def matrix_quants(quant: str) -> tuple[str, str]:
    """(gate_up's, down's) quantization of a blob: "q4_k/q6_k" names both, "int4" one for both."""
    gate_up, _, down = quant.partition("/")
    return gate_up, down or gate_up


def matrix_quant(quant: str, name: str) -> str:
    """The quantization of matrix `name` ("gate_up" or "down", or a dense matrix) in a blob of `quant`."""
    gate_up, down = matrix_quants(quant)
    return down if name.startswith("down") else gate_up


def expert_layout(hidden: int, expert_size: int, quant: str, group: int) -> list[Part]:
    gate_up, down = matrix_quants(quant)
    specs = matrix_parts("gate_up", 2 * expert_size, hidden, gate_up, group)
    specs += matrix_parts("down", hidden, expert_size, down, group)
    parts, offset = [], 0
    for name, dtype, shape in specs:
        part = Part(name, dtype, shape, offset)
        parts.append(part)
        offset = align(offset + part.nbytes, PART_ALIGN)
    return parts


def blob_nbytes(parts: list[Part]) -> int:
    return align(parts[-1].offset + parts[-1].nbytes, PART_ALIGN)


def layer_quants(recipe: str, moe_layers: list[int]) -> dict[int, str]:
    """Quantization of each MoE layer's experts. `mixed` keeps the first and last MoE
    layers at int8 (they are the most sensitive) and puts the rest at int4."""
    if recipe != "mixed":
        return {layer: recipe for layer in moe_layers}
    edge = {moe_layers[0], moe_layers[-1]} if moe_layers else set()
    return {layer: "int8" if layer in edge else "int4" for layer in moe_layers}


def check_group(group: int, hidden: int, expert_size: int) -> None:
    if hidden % group or expert_size % group or group % 2:
        raise ValueError(f"int4 group size {group} must be even and divide hidden size {hidden} "
                         f"and expert size {expert_size}")


def expert_blob_sizes(hidden: int, expert_size: int, recipe: str, moe_layers: list[int],
                      group: int) -> dict[int, int]:
    """Bytes of one expert blob per MoE layer, for planning without a pack."""
    quants = layer_quants(recipe, moe_layers)
    return {layer: blob_nbytes(expert_layout(hidden, expert_size, q, group)) for layer, q in quants.items()}


DENSE_GROUP = 32                # --dense-quant int4: one fp16 scale per 32 inputs, as the experts


def dense_quantizable(name: str, shape: tuple, quant: str) -> bool:
    """Dense matrices worth quantising at load (--dense-quant): not norms, biases or the
    (precision-sensitive, small) routers (gpt-oss's is mlp.router); for int4 only those whose inputs
    split into groups. gpt-oss's experts' biases are matrices ([N, E] per layer) read row by row, an
    expert at a time: kept as they are."""
    if len(shape) != 2 or name.endswith(("mlp.gate.weight", "mlp.router.weight", "bias")):
        return False
    return quant == "int8" or shape[1] % DENSE_GROUP == 0

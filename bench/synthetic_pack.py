"""Write a pack of any shape with random weights and no checkpoint, so memory and speed can
be measured at real sizes (Qwen3-30B-A3B, Mixtral, OLMoE from ../shared/configs).

    .venv/bin/python bench/synthetic_pack.py ../shared/configs/qwen3-30b-a3b.json -o /tmp/q30.pack \\
        --quant int4 [--layers 8]

Weights are random (dense ~ N(0, 0.02), experts ~ N(0, 0.02) before quantization): the
output is noise, the bytes, shapes, plan and speed are real. --layers keeps the first N
layers, for a machine with less disk than the full model needs. --quant may also name GGUF
blocks as a file keeps them (q4_k, q5_k, q6_k, iq4_xs, or a Q4_K_M file's q4_k/q6_k; mxfp4):
random blocks with small scales, written as a GGUF file's experts would be, without the gguf
package (a GPU machine's image has none).
"""

from __future__ import annotations

import argparse
import json
import sys
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moefit.config import ModelConfig  # noqa: E402
from moefit.memory.footprint import dense_shapes  # noqa: E402
from moefit.pack import format as fmt  # noqa: E402
from moefit.pack.convert import write_pack  # noqa: E402
from moefit.pack.layout import GGUF_BLOCKS, GGUF_HALVES, matrix_quants  # noqa: E402

# a value for a super-block's fp16 scales small enough that its weights stay about as large as
# N(0, 0.02)'s (its codes and other scales are random bytes)
SMALL_SCALE = {"q4_k": 3e-5, "q5_k": 1.5e-5, "q6_k": 1e-5, "iq4_xs": 1e-5}
MXFP4_EXPONENT = 120          # MXFP4's e8m0 byte: 2^(120 - 128) times its doubled values (at most 12)


class RandomSource:
    """The tensor-source interface of pack.convert, drawing random weights on demand."""

    def __init__(self, model: ModelConfig, seed: int, distinct: int = 0):
        shapes = dense_shapes(model)
        if not model.tie_word_embeddings:
            shapes["model.embed_tokens.weight"] = (model.vocab_size, model.hidden_size)
        self.shapes = shapes
        self.dense_keys = list(shapes)
        self.model = model
        self.seed = seed
        self.distinct = distinct              # > 0: cycle through this many random experts (faster to make)
        self._drawn = {}

    def float_dtype(self) -> str:
        return "bf16"

    def _randn(self, shape, salt: int, scale: bool = False) -> torch.Tensor:
        """N(0, 0.02), or a norm's scale N(1, 1)."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + salt)
        std, mean = (1.0, 1.0) if scale else (0.02, 0.0)
        return (torch.randn(shape, generator=g) * std + mean).to(torch.bfloat16)

    def get(self, key: str) -> torch.Tensor:
        """A dense tensor, the same in every process (crc32: Python's hash of a name is salted per
        process, so each run drew other weights); a vector is a norm's scale, but for biases and
        gpt-oss's sinks, which are drawn as the matrices are (a bias of N(1, 1) is no model's)."""
        shape = self.shapes[key]
        scale = len(shape) == 1 and not key.endswith(("bias", "sinks"))
        return self._randn(shape, zlib.crc32(key.encode()) % 100_000, scale)

    def _index(self, layer: int, expert: int) -> int:
        """The random expert (layer, expert) is drawn as (cycling through `distinct` of them)."""
        n = layer * 10_000 + expert
        return n % self.distinct if self.distinct else n

    def expert(self, layer: int, expert: int):
        if self.distinct:
            n = self._index(layer, expert)
            if n not in self._drawn:
                self._drawn[n] = self._expert(n // 10_000, n % 10_000)
            return self._drawn[n]
        return self._expert(layer, expert)

    def expert_parts(self, layer: int, expert: int, quant: str, group: int):
        """A GGUF quant's blob parts (gate_up's blocks, down's), random; None for moefit's own
        quants (pack.convert quantizes expert() then)."""
        gate_up, down = matrix_quants(quant)
        if gate_up not in GGUF_BLOCKS:
            return None
        m, n = self.model, self._index(layer, expert)
        return [super_blocks(2 * m.expert_size, m.hidden_size, gate_up, self.seed * 1_000_003 + n),
                super_blocks(m.hidden_size, m.expert_size, down, self.seed * 1_000_003 + n + 5_000_000)]

    def _expert(self, layer: int, expert: int):
        m = self.model
        salt = 100_000 + layer * 10_000 + expert
        return (self._randn((2 * m.expert_size, m.hidden_size), salt),
                self._randn((m.hidden_size, m.expert_size), salt + 5_000_000))


def super_blocks(rows: int, cols: int, quant: str, seed: int) -> torch.Tensor:
    """[rows, cols / weights a block * block bytes] uint8 of random `quant` blocks, their scales small."""
    weights, size = GGUF_BLOCKS[quant]
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (rows, cols // weights, size), generator=g, dtype=torch.uint8)
    if quant == "mxfp4":
        blocks[:, :, 0] = MXFP4_EXPONENT
    else:
        half = torch.tensor([SMALL_SCALE[quant]], dtype=torch.float16).view(torch.uint8)
        for offset in GGUF_HALVES[quant]:
            blocks[:, :, offset:offset + 2] = half
    return blocks.reshape(rows, -1)


def word_tokenizer(vocab: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def build_pack(config: Path, out: Path, quant: str = "int4", group_size: int = 32, layers: int | None = None,
               seed: int = 0, distinct: int = 0, progress: bool = False) -> Path:
    """Write the pack; returns its path."""
    raw = json.loads(Path(config).read_text())
    if layers:
        text = raw.get("text_config", raw)                 # Qwen3.6 nests its text model's config
        text["num_hidden_layers"] = layers
        text["max_window_layers"] = min(text.get("max_window_layers", layers), layers)
        if isinstance(text.get("layer_types"), list):
            text["layer_types"] = text["layer_types"][:layers]
    model = ModelConfig.from_hf(raw)

    def tokenizer(out: Path) -> None:
        dest = out / fmt.TOKENIZER_DIR
        dest.mkdir(parents=True, exist_ok=True)
        word_tokenizer(model.vocab_size).save(str(dest / "tokenizer.json"))
        (dest / "tokenizer_config.json").write_text(json.dumps({"eos_token": None}))
    kept = {layer: quant for layer in model.moe_layers} if matrix_quants(quant)[0] in GGUF_BLOCKS else None
    write_pack(RandomSource(model, seed, distinct), raw, Path(out), quant, group_size, tokenizer, progress=progress,
               name=Path(config).stem, quants=kept)
    return Path(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", help="an HF config.json")
    ap.add_argument("-o", "--output", required=True)
    ap.add_argument("--quant", default="int4")
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument("--layers", type=int, help="keep only the first N layers")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--distinct", type=int, default=0, help="cycle through N random experts (faster)")
    args = ap.parse_args()
    out = build_pack(Path(args.config), Path(args.output), args.quant, args.group_size, args.layers, args.seed,
                     args.distinct, progress=True)
    from moefit.commands.pack import describe
    from moefit.pack.format import read_header
    print(describe(read_header(out)))


if __name__ == "__main__":
    main()

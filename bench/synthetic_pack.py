"""Write a pack of any shape with random weights and no checkpoint, so memory and speed can
be measured at real sizes (Qwen3-30B-A3B, Mixtral, OLMoE from ../shared/configs).

    .venv/bin/python bench/synthetic_pack.py ../shared/configs/qwen3-30b-a3b.json -o /tmp/q30.pack \\
        --quant int4 [--layers 8]

Weights are random (dense ~ N(0, 0.02), experts ~ N(0, 0.02) before quantization): the
output is noise, the bytes, shapes, plan and speed are real. --layers keeps the first N
layers, for a machine with less disk than the full model needs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moefit.config import ModelConfig  # noqa: E402
from moefit.memory.footprint import dense_shapes  # noqa: E402
from moefit.pack import format as fmt  # noqa: E402
from moefit.pack.convert import write_pack  # noqa: E402


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

    def _randn(self, shape, salt: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + salt)
        std = 1.0 if len(shape) == 1 else 0.02
        return (torch.randn(shape, generator=g) * std + (1.0 if len(shape) == 1 else 0.0)).to(torch.bfloat16)

    def get(self, key: str) -> torch.Tensor:
        return self._randn(self.shapes[key], hash(key) % 100_000)

    def expert(self, layer: int, expert: int):
        if self.distinct:
            n = (layer * 10_000 + expert) % self.distinct
            if n not in self._drawn:
                self._drawn[n] = self._expert(n // 10_000, n % 10_000)
            return self._drawn[n]
        return self._expert(layer, expert)

    def _expert(self, layer: int, expert: int):
        m = self.model
        salt = 100_000 + layer * 10_000 + expert
        return (self._randn((2 * m.expert_size, m.hidden_size), salt),
                self._randn((m.hidden_size, m.expert_size), salt + 5_000_000))


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
    write_pack(RandomSource(model, seed, distinct), raw, Path(out), quant, group_size, tokenizer, progress=progress,
               name=Path(config).stem)
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

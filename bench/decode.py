"""Decode and prefill speed: transformers' generate (fp32) against moefit at fp32, int8 and
int4, on one random mid-size Qwen3-MoE, in one run. Not a test.

    .venv/bin/python bench/decode.py [--threads 2] [--prompt 128] [--new 64] [--out bench/out]

Shape: hidden 1024, 8 layers, 32 experts, top-8, expert size 256, 16 heads / 4 KV heads,
vocab 32000 (pass --vocab 151936 for Qwen's). Everything runs on the CPU, batch 1.
If llama-cpp-python is installed it is measured too (GGUF conversion is left to the user:
pass --gguf-q8 FILE / --gguf-q4 FILE).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moefit.config import ServeConfig  # noqa: E402
from moefit.pack.convert import convert  # noqa: E402
from moefit.runtime.engine import Engine  # noqa: E402
from moefit.runtime.sampler import SamplingParams  # noqa: E402

REPEATS = 5          # each figure is the best of five runs (this machine is shared and noisy)


def build(out: Path, vocab: int) -> Path:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    from tokenizers import Tokenizer, models
    if (out / "config.json").exists():
        return out
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=vocab, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=256,
                         num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                         num_experts=32, num_experts_per_tok=8, max_position_embeddings=4096,
                         tie_word_embeddings=False, eos_token_id=None, bos_token_id=None)
    Qwen3MoeForCausalLM(cfg).save_pretrained(out, max_shard_size="200MB")
    Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0")).save(str(out / "tokenizer.json"))
    return out


def time_transformers(hf: Path, prompt: list[int], new: int) -> dict:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    gen = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    best = {"prefill_tok_s": 0.0, "decode_tok_s": 0.0}
    with torch.no_grad():
        model.generate(ids[:, :16], max_new_tokens=4, **gen)                 # warm-up, dropped
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            model(ids)
            prefill = time.perf_counter() - t0
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=new, **gen)
            total = time.perf_counter() - t0
            best = _best(best, {"prefill_tok_s": len(prompt) / prefill,
                                "decode_tok_s": (new - 1) / max(1e-9, total - prefill)})
    return best


def _best(a: dict, b: dict) -> dict:
    return {k: max(a[k], b[k]) if k != "tokens" else b[k] for k in b}


def time_moefit(pack: Path, prompt: list[int], new: int, dense_quant: str = "off") -> dict:
    engine = Engine.open(pack, ServeConfig(ctx=len(prompt) + new + 8, dense_quant=dense_quant))
    greedy = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    engine.generate(prompt[:16], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))   # warm-up
    best = {"prefill_tok_s": 0.0, "decode_tok_s": 0.0}
    for _ in range(REPEATS):
        engine.kv_tokens = []                                                # no prefix reuse between runs
        _, stats, _ = engine.generate(prompt, greedy)
        best = _best(best, {"prefill_tok_s": stats.prefill_tokens_per_s, "decode_tok_s": stats.decode_tokens_per_s,
                            "tokens": stats.generated})
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--work", default="/tmp/moefit-bench-decode")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    work = Path(args.work)
    hf = build(work / f"hf-{args.vocab}", args.vocab)
    prompt = torch.randint(0, args.vocab, (args.prompt,), generator=torch.Generator().manual_seed(1)).tolist()
    rows = {"transformers fp32": time_transformers(hf, prompt, args.new)}
    for quant in ("fp32", "int8", "int4"):
        pack = work / f"pack-{args.vocab}-{quant}"
        if not (pack / "moefit-pack.json").exists():
            convert(hf, pack, quant, progress=False)
        rows[f"moefit {quant}"] = time_moefit(pack, prompt, args.new)
        if quant != "fp32":                    # the dense matrices and lm_head quantised too
            rows[f"moefit {quant}+dense8"] = time_moefit(pack, prompt, args.new, "int8")
    report(rows, args)


def report(rows: dict, args) -> None:
    base = rows["transformers fp32"]
    lines = [f"# bench/decode.py: Qwen3-MoE random, hidden 1024, 8 layers, 32 experts top-8, expert 256, "
             f"16/4 heads, vocab {args.vocab}; prompt {args.prompt}, {args.new} new tokens, batch 1, best of {REPEATS}, "
             f"{args.threads} threads, torch {torch.__version__}, {platform.processor() or platform.machine()}",
             f"{'engine':<20} {'prefill tok/s':>14} {'x tf':>6} {'decode tok/s':>13} {'x tf':>6}"]
    for name, r in rows.items():
        lines.append(f"{name:<20} {r['prefill_tok_s']:>14.1f} {r['prefill_tok_s'] / base['prefill_tok_s']:>6.2f} "
                     f"{r['decode_tok_s']:>13.1f} {r['decode_tok_s'] / base['decode_tok_s']:>6.2f}")
    text = "\n".join(lines)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"decode-vocab{args.vocab}.txt").write_text(text + "\n")
    (out / f"decode-vocab{args.vocab}.json").write_text(json.dumps(
        {k: {kk: vv for kk, vv in v.items() if kk != "tokens"} for k, v in rows.items()}, indent=1))


if __name__ == "__main__":
    main()

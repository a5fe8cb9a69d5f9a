"""Decode and prefill speed: transformers' generate (fp32) against moefit at fp32, int8 and
int4, on one random mid-size Qwen3-MoE, in one run. Not a test.

    .venv/bin/python bench/decode.py [--threads 2] [--prompt 128] [--new 64] [--out bench/out]

Shape: hidden 1024, 8 layers, 32 experts, top-8, expert size 256, 16 heads / 4 KV heads,
vocab 32000 (pass --vocab 151936 for Qwen's). Everything runs on the CPU, batch 1.
--shape big: Qwen3-30B-A3B's expert shape, 12 layers, 64 experts. --shape hybrid: Qwen3.6-35B-A3B's
layers (Qwen3.5-MoE: 3 Gated DeltaNet layers to one gated full-attention layer, a shared expert),
its first 8 layers, 64 of its 256 experts. --shape gpt-oss: gpt-oss-20b's first 4 layers (a sliding
window of 128 and full attention alternating, sinks, biased clamped experts), all 32 experts, top-4.

Routing is spread: every engine samples at temperature 2 with a fixed seed, so each step
routes to new experts (greedy decoding of a random model repeats one token and 94 % of a
step's experts are the previous step's, which the caches flatter); the run prints how many
distinct (layer, expert) pairs decoding touched. llama.cpp (llama-cpp-python) is timed on
GGUF files of the same checkpoint when given: --gguf NAME=FILE (F32, Q8_0, Q4_0, ...). Each row
runs in a process of its own (apart()).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

# The OpenMP wait policy the user gave (importing moefit sets PASSIVE where none is): llama.cpp's
# and transformers' rows run with it, moefit's with moefit's own. A moefit row run straight from
# the command line (--row, as the A/B scripts do) sets it here, before torch loads OpenMP: set once
# torch is imported it did not apply, and such a row's prompts ran 8-13 % slower than a user's
# (bench/results/decode-hybrid-q4km-round37-avx2-alternated.txt).
USER_OMP_POLICY = os.environ.get("OMP_WAIT_POLICY")


def _moefit_row() -> bool:
    """Whether this process runs one moefit row (--row '{"fn": "time_moefit", ...}')."""
    at = sys.argv.index("--row") + 1 if "--row" in sys.argv else len(sys.argv)
    return at < len(sys.argv) and json.loads(sys.argv[at]).get("fn") == "time_moefit"


if _moefit_row():
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moefit.config import ServeConfig  # noqa: E402
from moefit.pack.convert import convert  # noqa: E402
from moefit.runtime.engine import Engine  # noqa: E402
from moefit.runtime.sampler import SamplingParams  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from tiny import real_tokenizer  # noqa: E402

REPEATS = 5          # each figure is the best of five runs (this machine is shared and noisy)
SPREAD = dict(temperature=2.0, seed=0)


SHAPES = {
    "small": dict(hidden_size=1024, intermediate_size=2048, moe_intermediate_size=256, num_hidden_layers=8,
                  num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=32),
    # int4 experts of 2 GB (Qwen3-30B-A3B's expert shape, 12 of its layers, half its experts)
    "big": dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=12,
                num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=64),
    # Qwen3.6-35B-A3B's layers (../shared/configs/qwen3.6-35b-a3b.json), its first 8, 64 of its 256 experts
    "hybrid": dict(hidden_size=2048, moe_intermediate_size=512, shared_expert_intermediate_size=512,
                   num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                   num_experts=64, partial_rotary_factor=0.25, full_attention_interval=4, linear_num_key_heads=16,
                   linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                   linear_conv_kernel_dim=4, mtp_num_hidden_layers=0),
    # gpt-oss-20b's layers (configs/gpt-oss-20b.json), its first 4 (2 sliding, 2 full), all 32 experts
    "gpt-oss": dict(hidden_size=2880, intermediate_size=2880, num_hidden_layers=4, num_attention_heads=64,
                    num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4,
                    sliding_window=128, layer_types=["sliding_attention", "full_attention"] * 2),
}
FAMILY = {"hybrid": "Qwen3.5-MoE (6 DeltaNet + 2 attention layers)", "gpt-oss": "gpt-oss (2 sliding + 2 full layers)"}


def build(out: Path, vocab: int, shape: str = "small") -> Path:
    """A random Qwen3-MoE checkpoint (Qwen3.5-MoE for the hybrid shape, gpt-oss for its own; bf16
    but for the small shape); with vocab 151936 it carries Qwen3's real tokenizer, so that
    llama.cpp's converter accepts it."""
    import transformers
    from tokenizers import Tokenizer, models
    if (out / "config.json").exists():
        return out
    torch.manual_seed(0)
    names = {"hybrid": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"), "gpt-oss": ("GptOssConfig", "GptOssForCausalLM")}
    config, causal_lm = (getattr(transformers, n) for n in names.get(shape, ("Qwen3MoeConfig", "Qwen3MoeForCausalLM")))
    cfg = config(vocab_size=vocab, max_position_embeddings=4096, tie_word_embeddings=False, eos_token_id=None,
                 bos_token_id=None, **{"num_experts_per_tok": 8, **SHAPES[shape]})
    dtype = torch.float32 if shape == "small" else torch.bfloat16
    with torch.device("cpu"):
        torch.set_default_dtype(dtype)
        model = causal_lm(cfg)
        torch.set_default_dtype(torch.float32)
    model.save_pretrained(out, max_shard_size="1GB")
    if vocab >= 151669:
        real_tokenizer("qwen-3", out)
    else:
        Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0")).save(str(out / "tokenizer.json"))
    return out


def time_transformers(hf: Path, prompt: list[int], new: int) -> dict:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    gen = dict(do_sample=True, temperature=SPREAD["temperature"], top_k=0, top_p=1.0, eos_token_id=None,
               pad_token_id=0)
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
    return {k: max(a.get(k, 0), b[k]) for k in b}


def apart(fn: str, *args) -> dict:
    """fn(*args) (time_transformers, time_moefit, time_llama) in a process of its own: a row's rate
    depended on what ran before it in one process (the same pack decoded 20-27 % faster after
    llama.cpp's rows than before them; alike when each ran alone)."""
    row = json.dumps({"fn": fn, "args": [str(a) if isinstance(a, Path) else a for a in args],
                      "threads": torch.get_num_threads()})
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY" or fn == "time_moefit"}
    if fn != "time_moefit" and USER_OMP_POLICY:
        env["OMP_WAIT_POLICY"] = USER_OMP_POLICY
    run = subprocess.run([sys.executable, __file__, "--row", row], capture_output=True, text=True, env=env)
    if run.returncode:
        raise SystemExit(f"{fn} failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def time_moefit(pack: Path, prompt: list[int], new: int, threads: int, dense_quant: str = "off") -> dict:
    engine = Engine.open(Path(pack), ServeConfig(ctx=len(prompt) + new + 8, dense_quant=dense_quant, threads=threads))
    spread = SamplingParams(max_tokens=new, ignore_eos=True, **SPREAD)
    engine.generate(prompt[:16], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))   # warm-up
    best = {"prefill_tok_s": 0.0, "decode_tok_s": 0.0}
    for _ in range(REPEATS):
        engine.kv_tokens = []                                                # no prefix reuse between runs
        before = engine.runner.profile.counts.copy()
        _, stats, _ = engine.generate(prompt, spread)
        touched = int(((engine.runner.profile.counts - before) > 0).sum())
        best = _best(best, {"prefill_tok_s": stats.prefill_tokens_per_s, "decode_tok_s": stats.decode_tokens_per_s,
                            "experts_touched": touched})
    return best


def time_llama(gguf: str, prompt: list[int], new: int, threads: int) -> dict:
    from llama_cpp import Llama
    llm = Llama(model_path=gguf, n_ctx=len(prompt) + new + 8, n_threads=threads, n_batch=len(prompt),
                verbose=False, logits_all=False)
    best = {"prefill_tok_s": 0.0, "decode_tok_s": 0.0}
    for _ in range(REPEATS + 1):                                             # the first is the warm-up
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        prefill = time.perf_counter() - t0
        best = _best(best, {"prefill_tok_s": len(prompt) / prefill, "decode_tok_s": llama_decode_rate(llm, new)})
    return best


def llama_decode_rate(llm, new: int) -> float:
    """Tokens a second of llama.cpp generating new - 1 tokens at the spread temperature after what
    it has evaluated."""
    t0, n = time.perf_counter(), 0
    for _token in llm.generate([], temp=SPREAD["temperature"], top_k=0, top_p=1.0, min_p=0.0, reset=False):
        n += 1
        if n == new - 1:
            break
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--work", default="/tmp/moefit-bench-decode")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--gguf", action="append", default=[], metavar="NAME=FILE",
                    help="time llama.cpp on this GGUF of the same checkpoint (e.g. Q4_0=/tmp/m-q4_0.gguf)")
    ap.add_argument("--only", default="fp32,int8,int4", help="moefit quants to run")
    ap.add_argument("--same-file", action="store_true",
                    help="also time moefit on packs made from each --gguf file itself (its expert blocks kept: "
                         "Q4_0 as int4, Q8_0 as q8_0, K-quants as they are), the dense matrices at about its bits")
    ap.add_argument("--shape", default="small", choices=SHAPES)
    ap.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline (big shape)")
    ap.add_argument("--row", help=argparse.SUPPRESS)             # apart(): one row, in this process
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.row:
        spec = json.loads(args.row)
        torch.set_num_threads(spec["threads"])
        print(json.dumps(globals()[spec["fn"]](*spec["args"])))
        return
    work = Path(args.work)
    tag = f"{args.shape}-{args.vocab}" if args.shape != "small" else str(args.vocab)
    hf = build(work / f"hf-{tag}", args.vocab, args.shape)
    prompt = torch.randint(0, args.vocab, (args.prompt,), generator=torch.Generator().manual_seed(1)).tolist()
    rows = {} if args.no_transformers else {"transformers fp32": apart("time_transformers", hf, prompt, args.new)}
    for quant in args.only.split(","):
        pack = work / f"pack-{tag}-{quant}"
        if not (pack / "moefit-pack.json").exists():
            convert(hf, pack, quant, progress=False)
        rows[f"moefit {quant}"] = apart("time_moefit", pack, prompt, args.new, args.threads)
        if quant != "fp32":                    # the dense matrices and lm_head quantised too
            rows[f"moefit {quant}+dense8"] = apart("time_moefit", pack, prompt, args.new, args.threads, "int8")
        if quant == "int4":
            rows[f"moefit {quant}+dense4"] = apart("time_moefit", pack, prompt, args.new, args.threads, "int4")
    for spec in args.gguf:
        name, file = spec.split("=", 1)
        rows[f"llama.cpp {name}"] = apart("time_llama", file, prompt, args.new, args.threads)
        if args.same_file:                 # the file's own expert blocks; the dense matrices at about its bits
            dense = dense_bits(file)
            pack = work / f"pack-keep-{Path(file).stem}"
            if not (pack / "moefit-pack.json").exists():
                convert(Path(file), pack, "keep", progress=False)
            layers = json.loads((pack / "moefit-pack.json").read_text())["quant"]["layers"]
            kept = "+".join(sorted(set(layers.values())))
            rows[f"moefit from {name} ({kept}+dense{dense[-1]})"] = apart(
                "time_moefit", pack, prompt, args.new, args.threads, dense)
    report(rows, args)


def dense_bits(gguf_file: str) -> str:
    """moefit's --dense-quant nearest the file's attention matrices: int8 for 8 bits (Q8_0: a
    Q8_0 file's, and llama.cpp's MXFP4_MOE's), int4 for fewer."""
    from gguf import GGMLQuantizationType
    from moefit.pack.gguf_file import GGUFFile
    kind = next(t.tensor_type for t in GGUFFile(gguf_file).tensors if t.name.endswith("attn_q.weight"))
    return "int8" if kind in (GGMLQuantizationType.Q8_0, GGMLQuantizationType.F16, GGMLQuantizationType.BF16) else "int4"


def report(rows: dict, args) -> None:
    base = next(iter(rows.values()))
    sh = SHAPES[args.shape]
    family = FAMILY.get(args.shape, "Qwen3-MoE")
    experts, top = sh.get("num_experts") or sh["num_local_experts"], sh.get("num_experts_per_tok", 8)
    lines = [f"# bench/decode.py: {family} random, hidden {sh['hidden_size']}, {sh['num_hidden_layers']} layers, "
             f"{experts} experts top-{top}, expert {sh.get('moe_intermediate_size') or sh['intermediate_size']}, "
             f"{sh['num_attention_heads']}/{sh['num_key_value_heads']} heads, vocab {args.vocab}; prompt {args.prompt}, "
             f"{args.new} new tokens, batch 1, best of {REPEATS}, {args.threads} threads, torch {torch.__version__}, "
             f"{platform.processor() or platform.machine()}, each row in a process of its own, OMP_WAIT_POLICY "
             f"{os.environ.get('OMP_WAIT_POLICY')} for moefit (its default), {USER_OMP_POLICY or 'unset'} for the others "
             f"(llama.cpp's decode wants its spinning); "
             f"ratios (x) against the first row",
             f"{'engine':<20} {'prefill tok/s':>14} {'x':>6} {'decode tok/s':>13} {'x':>6} {'experts':>8}"]
    for name, r in rows.items():
        lines.append(f"{name:<20} {r['prefill_tok_s']:>14.1f} {r['prefill_tok_s'] / base['prefill_tok_s']:>6.2f} "
                     f"{r['decode_tok_s']:>13.1f} {r['decode_tok_s'] / base['decode_tok_s']:>6.2f} "
                     f"{r.get('experts_touched', ''):>8}")
    lines.append("experts: distinct (layer, expert) pairs one run touched (of "
                 f"{sh['num_hidden_layers'] * experts}); llama.cpp rows: the same checkpoint as GGUF, "
                 "same threads")
    text = "\n".join(lines)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"decode-{args.shape}-vocab{args.vocab}" if args.shape != "small" else f"decode-vocab{args.vocab}"
    (out / f"{name}.txt").write_text(text + "\n")
    (out / f"{name}.json").write_text(json.dumps(
        {k: {kk: vv for kk, vv in v.items() if kk != "tokens"} for k, v in rows.items()}, indent=1))


if __name__ == "__main__":
    main()

"""Decode at a long context on the host: moefit and llama.cpp on the same checkpoint, after the
same prompt of --prompt tokens, with the KV cache at about the same bits, in one run. Not a test.

    .venv/bin/python bench/long_decode.py PACK GGUF [--prompt 8192] [--new 32] [--kv-dtype int8]
        [--threads 2] [--torch-route]

PACK and GGUF: the same checkpoint (bench/decode.py builds the hybrid one, bench/make_gguf.py its
GGUF files). moefit serves PACK with --dense-quant int4 and --kv-dtype; llama.cpp runs the GGUF with
flash attention and its KV cache in the matching type (int8 -> Q8_0, q4 -> Q4_0, fp16 -> F16;
fp32 -> F32 without flash attention). Each engine first consumes the whole prompt once untimed
(the warm-up: moefit measures each new product shape's fastest GEMM way the first time it meets
it, kernels/gemm.py, and a served start keeps those choices in measured.json, so only a host's very
first prompt pays it), then consumes it again (timed) and decodes --new tokens at temperature 2
(timed; spread routing, as bench/decode.py). With
--torch-route moefit runs once more with its native attention declined (kernels/kv.h and
moe_attend_one returning None): the route a quantised cache took before.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moefit.config import ServeConfig  # noqa: E402
from moefit.kernels import rows  # noqa: E402
from moefit.runtime.engine import Engine  # noqa: E402
from moefit.runtime.sampler import SamplingParams  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import llama_decode_rate  # noqa: E402

LLAMA_KV = {"int8": (8, True), "q4": (2, True), "fp16": (1, True), "fp32": (0, False)}   # ggml type, flash
SPREAD = dict(temperature=2.0, top_k=0, top_p=1.0, seed=7)        # llama.cpp's: decode.py's, the same temperature


def time_moefit(pack: Path, prompt: list[int], new: int, threads: int, kv_dtype: str) -> dict:
    engine = Engine.open(pack, ServeConfig(ctx=len(prompt) + new + 8, dense_quant="int4", kv_dtype=kv_dtype,
                                           threads=threads))
    engine.generate(prompt, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))       # warm-up
    engine.kv_tokens = []
    _, stats, _ = engine.generate(prompt, SamplingParams(max_tokens=new, ignore_eos=True, **SPREAD))
    return {"prefill_tok_s": stats.prefill_tokens_per_s, "decode_tok_s": stats.decode_tokens_per_s}


def time_llama(gguf: str, prompt: list[int], new: int, threads: int, kv_dtype: str) -> dict:
    from llama_cpp import Llama
    kind, flash = LLAMA_KV[kv_dtype]
    llm = Llama(model_path=gguf, n_ctx=len(prompt) + new + 8, n_threads=threads, n_batch=512, verbose=False,
                flash_attn=flash, type_k=kind, type_v=kind)
    llm.eval(prompt)                                                         # warm-up
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt)
    prefill = time.perf_counter() - t0
    return {"prefill_tok_s": len(prompt) / prefill, "decode_tok_s": llama_decode_rate(llm, new)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pack", type=Path)
    ap.add_argument("gguf")
    ap.add_argument("--prompt", type=int, default=8192)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--kv-dtype", default="int8", choices=sorted(LLAMA_KV))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--torch-route", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    prompt = torch.randint(100, 30000, (args.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    print(f"# {platform.processor() or platform.machine()}, {args.threads} threads, prompt {args.prompt}, "
          f"new {args.new}, KV {args.kv_dtype} (llama.cpp type {LLAMA_KV[args.kv_dtype][0]}, "
          f"flash {LLAMA_KV[args.kv_dtype][1]})", flush=True)
    results = {"moefit": time_moefit(args.pack, prompt, args.new, args.threads, args.kv_dtype)}
    print("moefit", results["moefit"], flush=True)
    results["llama.cpp"] = time_llama(args.gguf, prompt, args.new, args.threads, args.kv_dtype)
    print("llama.cpp", results["llama.cpp"], flush=True)
    if args.torch_route:
        real, real_one = rows.attend_stored, rows.attend_one
        rows.attend_stored = rows.attend_one = lambda *a, **kw: None
        results["moefit, torch attention"] = time_moefit(args.pack, prompt, args.new, args.threads, args.kv_dtype)
        rows.attend_stored, rows.attend_one = real, real_one
        print("moefit, torch attention", results["moefit, torch attention"], flush=True)
    base = results["llama.cpp"]
    for name, r in results.items():
        print(f"{name:26} prefill {r['prefill_tok_s']:7.1f} tok/s ({r['prefill_tok_s'] / base['prefill_tok_s']:.2f}x)"
              f"   decode {r['decode_tok_s']:6.2f} tok/s ({r['decode_tok_s'] / base['decode_tok_s']:.2f}x)")


if __name__ == "__main__":
    main()

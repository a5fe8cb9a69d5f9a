"""moefit pack HF_DIR|MODEL.gguf -o PACK [--quant fp32|fp16|bf16|int8|int4|q8_0|mixed] [--requant Q]"""

from __future__ import annotations

import sys

from moefit.memory.ledger import mib
from moefit.pack.layout import RECIPES


def register(sub) -> None:
    p = sub.add_parser("pack", help="convert a Hugging Face checkpoint or a GGUF file into a native pack")
    p.add_argument("hf_dir", help="checkpoint directory (config.json, safetensors, tokenizer), or a .gguf file "
                   "(its experts' blocks kept as they are where moefit has their layout)")
    p.add_argument("-o", "--output", required=True, help="the pack directory to write")
    p.add_argument("--quant", default=None, choices=RECIPES,
                   help="expert quantization (default: bf16 for a checkpoint; a GGUF file's own blocks); "
                        "mixed = int8 in the first and last MoE layers, int4 elsewhere")
    p.add_argument("--requant", choices=RECIPES, help="a GGUF file: re-quantise every expert to this "
                   "(the way out for types moefit does not keep, Q4_K, Q6_K, IQ4_XS ...); same as --quant")
    p.add_argument("--group-size", type=int, default=32, help="int4 group size (inputs per scale)")
    p.set_defaults(run=run)


def run(args) -> int:
    from moefit.pack.convert import convert
    header = convert(args.hf_dir, args.output, args.requant or args.quant, args.group_size,
                     progress=sys.stderr.isatty())
    print(describe(header))
    print("  no expert profile yet: until one is recorded the expert cache fills in pack order (a uniform "
          "guess); record one with `moefit profile PACK --prompts FILE`, or let `serve` learn it as it runs")
    return 0


def describe(header: dict) -> str:
    index = header["experts"]["index"]
    sizes = [row[3] for row in index]
    dense = sum(t["nbytes"] for t in header["dense"]["tensors"].values())
    q = header["quant"]
    source = header["model_config"].get("moefit_source")
    origin = ("  from " + source["gguf"] + ": " + ", ".join(f"{n} x {k}" for k, n in sorted(source["types"].items()))
              + "\n") if source else ""
    origin += _unknown_pre_tokenizer(source) if source else ""
    layers = sorted({row[0] for row in index})
    mtp = (header.get("mtp") or {}).get("layers", 0)
    if mtp:
        origin += (f"  the last {mtp} of those layers {'is an MTP layer' if mtp == 1 else 'are MTP layers'}: a draft "
                   "source for --spec mtp (its experts run on the host)\n")
    return (f"packed {header['family']}: {len(layers)} MoE layers x {len(index) // max(1, len(layers))} experts, "
            f"experts {q['recipe']}" + (f" (group {q['group_size']})" if q["recipe"] in ("int4", "mixed") else "")
            + (f" ({', '.join(sorted(set(q['layers'].values())))})" if q["recipe"] == "keep" else "")
            + f", dense {q['dense_dtype']}\n"
            f"  dense {mib(dense):.1f} MiB; experts {mib(sum(sizes)):.1f} MiB in {len(sizes)} blobs "
            f"({min(sizes) / 1024:.1f}-{max(sizes) / 1024:.1f} KiB each)\n{origin}  pack id {header['pack_id']}")


def _unknown_pre_tokenizer(source: dict) -> str:
    """A GGUF file's pre-tokenizer moefit has no splits for: said, since GPT-2's stand in for it."""
    from moefit.pack.gguf_source import PRE_TOKENIZERS
    pre = source.get("pre_tokenizer", "gpt-2")
    if pre in PRE_TOKENIZERS:
        return ""
    return (f"  warning: its pre-tokenizer {pre!r} is not one moefit knows: words are split as GPT-2's are, which "
            f"may not be how the model was trained (known: {', '.join(PRE_TOKENIZERS)})\n")

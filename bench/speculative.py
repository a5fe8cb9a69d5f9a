"""Speculative decoding on the bundled demo model (not a test): tok/s with and without each
draft source on (a) an input-grounded task (the prompt holds the text the answer repeats)
and (b) free generation, with acceptance and distinct experts per window.

    .venv/bin/python bench/speculative.py [--tokens 200] [--device cpu|sim:CARD]

The draft head is trained first (moefit train-draft) on WordNet-style text if the pack has none.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moefit.config import ServeConfig  # noqa: E402
from moefit.demo import demo_pack  # noqa: E402
from moefit.runtime.engine import Engine  # noqa: E402
from moefit.runtime.report import speculative_json  # noqa: E402
from moefit.runtime.sampler import SamplingParams  # noqa: E402

GROUNDED = ("Define: lantern\nlantern (noun): light in a transparent protective case. Also: lanthorn.\n"
            "Define: river\nriver (noun): a large natural stream of water (larger than a creek). "
            "For example: \"the river was navigable for 50 miles\".\n"
            "Define: harbor\nharbor (noun): a sheltered port where ships can take on or discharge cargo. "
            "Also: harbour.\n") * 2 + "Define: lantern\n"
FREE = "<|im_start|>user\nDefine: orchestra<|im_end|>\n<|im_start|>assistant\n"


def ensure_draft_head(pack: Path, work: Path) -> Path:
    target = work / "demo-with-head.pack"
    if (target / "draft.bin").exists():
        return target
    shutil.copytree(pack, target, dirs_exist_ok=True)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    from train_demo import documents
    corpus = work / "corpus.txt"
    corpus.write_text("".join(documents(7)[:3000]))
    from moefit.cli import main as cli
    cli(["train-draft", str(target), "--corpus", str(corpus), "--heads", "3", "--steps", "600"])
    return target


def measure(pack: Path, prompt: str, mode: str, tokens: int, device: str) -> dict:
    engine = Engine.open(pack, ServeConfig(device=device, ctx=2048, spec=mode, spec_window=4,
                                           vram_reserve_mib=3 if device != "cpu" else None))
    ids = engine.codec.encode(prompt)
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    engine.generate(ids[:8], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))   # warm-up
    engine.kv_tokens = []
    text, stats, _ = engine.generate(ids, params)
    spec = speculative_json(engine)
    return {"tok_s": stats.decode_tokens_per_s, "tokens": stats.generated, "acceptance": spec["acceptance_rate"],
            "accepted_per_window": spec["accepted_per_window"], "windows": spec["windows"],
            "distinct_experts": spec["distinct_experts_per_window"], "misses": spec["misses_per_window"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", default="/tmp/moefit-bench-spec")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    base = demo_pack()
    with_head = ensure_draft_head(base, work)
    print(f"# bench/speculative.py: demo model ({base.name}), {args.tokens} greedy tokens, device {args.device}, "
          f"{args.threads} threads")
    print(f"{'task':<14} {'draft source':<12} {'tok/s':>7} {'x off':>6} {'accept':>7} {'acc/win':>8} "
          f"{'experts/win':>12} {'misses/win':>11} {'same output':>12}")
    for task, prompt in (("grounded (a)", GROUNDED), ("free (b)", FREE)):
        off = measure(base, prompt, "off", args.tokens, args.device)
        for mode, pack in (("off", base), ("lookup", base), ("head", with_head)):
            r = off if mode == "off" else measure(pack, prompt, mode, args.tokens, args.device)
            print(f"{task:<14} {mode:<12} {r['tok_s']:>7.1f} {r['tok_s'] / off['tok_s']:>6.2f} "
                  f"{r['acceptance']:>7.2f} {r['accepted_per_window']:>8.2f} {r['distinct_experts']:>12.1f} "
                  f"{r['misses']:>11.1f} {str(r['tokens'] == off['tokens']):>12}")


if __name__ == "__main__":
    main()

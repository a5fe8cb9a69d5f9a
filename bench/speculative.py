"""Speculative decoding on the bundled demo model (not a test): tok/s with and without each
draft source on (a) an input-grounded task (the prompt holds the text the answer repeats)
and (b) free generation, with acceptance and distinct experts per window.

    .venv/bin/python bench/speculative.py [--tokens 200] [--device cpu|sim:CARD] [--mtp-only]

The draft head is trained first (moefit train-draft) on WordNet-style text if the pack has none.

The MTP rows run a Qwen3-Next-shaped random checkpoint (hidden 128, 4 layers, 16 experts) with a
random MTP layer (tests/tiny.py: add_mtp): the demo (Qwen3-MoE) has no MTP layer, and a random
model's next-but-one token cannot be learned (an MTP layer fitted to its own greedy continuations
by self-distillation reached 0.00 top-1 on held-out ones), so they measure what drafting costs
(ms per MTP draft against a decode step) and that the window stops paying for it, not acceptance.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
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


def mtp_pack(work: Path) -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import tiny
    from moefit.pack.convert import convert
    pack = work / "qwen3-next-mtp.pack"
    if not pack.exists():
        ckpt = tiny.build_checkpoint("qwen3_next", work / "qwen3-next-mtp", hidden_size=128, num_experts=16,
                                     moe_intermediate_size=128, shared_expert_intermediate_size=128)
        convert(tiny.add_mtp(ckpt, "qwen3_next"), pack, recipe="int8", progress=False)
    return pack


def mtp_rows(work: Path, tokens: int, device: str) -> None:
    pack = mtp_pack(work)
    prompt = ([5, 17, 42, 99, 7, 3, 150, 220, 31, 64] * 6)[:56]
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    print(f"\n# MTP: {pack.name} (Qwen3-Next shape, random weights, int8), {tokens} greedy tokens")
    print(f"{'draft source':<12} {'tok/s':>7} {'x off':>6} {'accept':>7} {'windows':>8} {'ms/step':>8} "
          f"{'ms/draft':>9} {'same output':>12}")
    off = None
    for mode in ("off", "lookup", "mtp"):
        engine = Engine.open(pack, ServeConfig(device=device, ctx=512, spec=mode, spec_window=4))
        engine.generate(prompt[:8], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))   # warm-up
        engine.kv_tokens = []
        drafting = _timed(engine.mtp, "propose") if engine.mtp is not None else None
        stats = engine.generate(prompt, params)[1]
        spec = speculative_json(engine)
        off = off or stats
        step_ms = 1e3 / off.decode_tokens_per_s
        draft_ms = drafting.seconds * 1e3 / max(1, spec["drafted"]) if drafting else 0.0
        rate = stats.decode_tokens_per_s
        print(f"{mode:<12} {rate:>7.1f} {rate / off.decode_tokens_per_s:>6.2f} {spec['acceptance_rate']:>7.2f} "
              f"{spec['windows']:>8} {step_ms:>8.2f} {draft_ms:>9.2f} {str(stats.generated == off.generated):>12}")


class _timed:
    """Seconds spent in obj.name (wrapped in place)."""

    def __init__(self, obj, name: str):
        self.seconds, real = 0.0, getattr(obj, name)

        def wrapped(*a, **k):
            t0 = time.perf_counter()
            try:
                return real(*a, **k)
            finally:
                self.seconds += time.perf_counter() - t0
        setattr(obj, name, wrapped)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", default="/tmp/moefit-bench-spec")
    ap.add_argument("--mtp-only", action="store_true", help="only the MTP rows")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.mtp_only:
        return mtp_rows(work, args.tokens, args.device)
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
    mtp_rows(work, args.tokens, args.device)


if __name__ == "__main__":
    main()

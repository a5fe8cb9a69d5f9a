"""moefit train-draft PACK --corpus FILE: train a draft head on the base model's hidden states."""

from __future__ import annotations

import sys
from pathlib import Path

from moefit.errors import UsageError


def register(sub) -> None:
    p = sub.add_parser("train-draft", help="train a speculative draft head and store it in the pack")
    p.add_argument("pack", help="the pack directory")
    p.add_argument("--corpus", required=True, help="a text file in the style the model will serve")
    p.add_argument("--heads", type=int, default=3, help="draft tokens per window the head proposes")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--max-tokens", type=int, default=20000, help="corpus tokens to run the model over")
    p.add_argument("--lr", type=float, default=1e-3)
    p.set_defaults(run=run)


def run(args) -> int:
    from moefit.config import ServeConfig
    from moefit.runtime import draft_head
    from moefit.runtime.engine import Engine
    text = Path(args.corpus).read_text()
    engine = Engine.open(args.pack, ServeConfig(device="cpu", ctx=256))
    tokens = engine.codec.encode(text)[: args.max_tokens]
    if len(tokens) < 512:
        raise UsageError(f"{args.corpus}: {len(tokens)} tokens; the draft head needs at least 512")
    head = draft_head.train(engine, tokens, args.heads, args.steps, args.lr,
                            log=lambda m: print(m, file=sys.stderr, flush=True))
    draft_head.save(Path(args.pack), head, {"corpus_tokens": len(tokens), "steps": args.steps})
    print(f"trained a {args.heads}-head draft on {len(tokens)} tokens into {args.pack}")
    return 0

"""moefit generate PACK --prompt TEXT [--chat] [--max-tokens N] [--temperature T] [--json]"""

from __future__ import annotations

import sys

from moefit.cli import add_serve_flags, add_state_flags, print_json, serve_config, start_options
from moefit.runtime.sampler import SamplingParams


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt")
    p.add_argument("pack", help="the pack directory")
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn of the chat template")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-text token")
    p.add_argument("--dump-routing", metavar="FILE", help="write every token's routing as JSON lines")
    p.add_argument("--json", action="store_true", help="print one JSON object (logs go to stderr)")
    add_serve_flags(p)
    add_state_flags(p)
    p.set_defaults(run=run)


def sampling(args) -> SamplingParams:
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                            seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos)
    try:
        params.check()
    except ValueError as e:
        from moefit.errors import UsageError
        raise UsageError(str(e)) from None
    return params


def run(args) -> int:
    from moefit.ops.startup import start_engine
    from moefit.runtime.report import status_json, summary_line
    cfg = serve_config(args)
    params = sampling(args)
    engine, start = start_engine(args.pack, cfg, start_options(args), command="generate")
    text_in = engine.codec.render_chat([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    prompt = engine.codec.encode(text_in)
    dump = open(args.dump_routing, "w") if args.dump_routing else None
    engine.runner.dump = dump
    try:
        pieces = []
        for event in engine.stream(prompt, params):
            pieces.append(event.text)
            if not args.json:
                print(event.text, end="", flush=True)
    finally:
        if dump:
            dump.close()
        start.finish(engine, final=True)
    stats = engine.last
    if args.json:
        print_json({**status_json(engine), "text": "".join(pieces), "token_ids": stats.generated,
                    "prompt_tokens": stats.prompt_tokens, "finish_reason": event.finish_reason,
                    "decode_tokens_per_s": stats.decode_tokens_per_s,
                    "prefill_tokens_per_s": stats.prefill_tokens_per_s, "start": start.summary()})
    else:
        print()
        print(summary_line(engine), file=sys.stderr)
    return 0

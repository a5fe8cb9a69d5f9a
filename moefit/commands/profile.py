"""moefit profile PACK --prompts FILE [--probe]: record expert hotness from real prompts into the
pack, and with --probe fit the look-ahead's probe on the same tokens (experts/probe.py)."""

from __future__ import annotations

from pathlib import Path

from moefit.errors import UsageError


def register(sub) -> None:
    p = sub.add_parser("profile", help="record expert hotness from prompts into the pack")
    p.add_argument("pack", help="the pack directory")
    p.add_argument("--prompts", required=True, help="a text file, one prompt per line")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens generated per prompt")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a chat user turn")
    p.add_argument("--probe", action="store_true",
                   help="also fit the look-ahead's probe (each MoE layer's routing from the layer before); "
                        "every fifth prompt is held out to score it")
    p.set_defaults(run=run)


def run(args) -> int:
    from moefit.config import ServeConfig
    from moefit.experts.probe import ProbeFit
    from moefit.experts.profile import Profile
    from moefit.runtime.engine import Engine
    from moefit.runtime.sampler import SamplingParams
    prompts = [line.strip() for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    if not prompts:
        raise UsageError(f"{args.prompts}: no prompts")
    engine = Engine.open(args.pack, ServeConfig(device="cpu", ctx=4096))
    m = engine.pack.model
    engine.runner.profile = Profile.empty(m.num_layers, m.num_experts)
    if args.probe:
        engine.loaded.model.probe_fit = ProbeFit(m.top_k)
    for n, text in enumerate(prompts):
        if args.probe:
            engine.loaded.model.probe_fit.begin(n)
        text = engine.codec.render_chat([{"role": "user", "content": text}]) if args.chat else text
        engine.generate(engine.codec.encode(text)[: 4000], SamplingParams(max_tokens=args.max_tokens, temperature=0))
    engine.save_profile()
    skew = engine.runner.profile.skew()
    moe = [f"{100 * skew[i]:.0f}%" for i in m.moe_layers]
    print(f"profiled {len(prompts)} prompts into {engine.pack.profile_path}")
    print(f"share of routings to each layer's hottest quarter of experts: {' '.join(moe)} (uniform: 25%)")
    if args.probe:
        report_probe(engine, len(prompts))
    return 0


def report_probe(engine, prompts: int) -> None:
    """Fit the probe, store it, and say per layer what it predicts against the router."""
    from moefit.experts.probe import save as save_probe
    fitted = engine.loaded.model.probe_fit.fit(engine.loaded.model)
    engine.loaded.model.probe_fit = None
    save_probe(engine.pack.path, fitted, prompts)
    rows = [f"layer {j}: router {fitted.router_recall[j]:.3f} probe {fitted.probe_recall[j]:.3f}"
            + ("" if j in fitted.matrices else " (router kept)") for j in sorted(fitted.router_recall)]
    print(f"look-ahead probe: {fitted.tokens} tokens fitted, {fitted.held_out} held out; recall of each layer's "
          f"top-{engine.pack.model.top_k} on the held-out tokens:")
    print("\n".join("  " + r for r in rows))

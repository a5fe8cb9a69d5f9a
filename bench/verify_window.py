"""How many experts a speculative verify window touches, and what it costs, by window size (not a
test): the demo model on its simulated card (a quarter of the experts cached, look-ahead on),
prompt lookup on an input-grounded task, the window fixed at k drafts (its adaptation off).

    .venv/bin/python bench/verify_window.py [--tokens 160]

Per window size: distinct experts a window routes to per MoE layer, the misses among them,
acceptance, and decode tok/s against plain decoding in the same script. The question it answers
(issue 18): would capping the experts a window may touch pay? A window of k+1 tokens routes to
fewer distinct experts than k+1 plain steps (consecutive tokens share experts) and pays its
misses once; the adaptive window (runtime/speculative.py) already shrinks k when a window's
measured cost, misses included, stops paying.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.speculative import GROUNDED  # noqa: E402
from moefit.config import ServeConfig  # noqa: E402
from moefit.demo import CARD, demo_pack, sim_flag  # noqa: E402
from moefit.runtime.engine import Engine  # noqa: E402
from moefit.runtime.report import speculative_json  # noqa: E402
from moefit.runtime.sampler import SamplingParams  # noqa: E402
from moefit.runtime.speculative import Window  # noqa: E402


class FixedWindow(Window):
    """k drafts every step: the window's own adaptation off, its statistics kept."""

    def size(self) -> int:
        return self.k_max

    def record(self, k, accepted, seconds, distinct_experts, misses) -> None:
        super().record(k, accepted, seconds, distinct_experts, misses)
        self.k, self.off_for = self.k_max, 0


def run(pack, k: int, tokens: int) -> dict:
    cfg = ServeConfig(device=f"sim:{CARD}", ctx=4096, prefill_chunk=128, low_headroom_mib=1,
                      vram_reserve_mib=int(sim_flag("--vram-reserve-mib")), spec="lookup" if k else "off",
                      spec_window=max(k, 1))
    engine = Engine.open(pack, cfg)
    engine.session.window = FixedWindow(max(k, 1))
    prompt = engine.codec.encode(GROUNDED)
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    engine.generate(prompt[:32], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))   # warm-up
    engine.kv_tokens = []
    book = engine.runner.book
    misses0 = int(book.misses.sum())
    _, stats, _ = engine.generate(prompt, params)
    layers = len(engine.pack.model.moe_layers)
    spec = speculative_json(engine)
    decoded = len(stats.generated)
    return {"tok_s": stats.decode_tokens_per_s, "acceptance": spec["acceptance_rate"],
            "experts_per_layer_window": spec["distinct_experts_per_window"] / layers if k else None,
            "misses_per_layer_window": spec["misses_per_window"] / layers if k else None,
            "misses_per_token_layer": (int(book.misses.sum()) - misses0) / max(1, decoded) / layers}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=160)
    args = ap.parse_args()
    pack = demo_pack(log=print)
    print(f"# bench/verify_window.py: demo on its simulated card, prompt lookup, grounded task, {args.tokens} greedy "
          "tokens, window fixed at k drafts; per MoE layer: distinct experts and misses a window routes to")
    print(f"{'k':>3} {'tok/s':>7} {'x plain':>7} {'accept':>7} {'experts/window':>15} {'misses/window':>14} "
          f"{'misses/token':>13}")
    plain = run(pack, 0, args.tokens)
    top_k = Engine.open(pack, ServeConfig(ctx=64)).pack.model.top_k
    print(f"{'off':>3} {plain['tok_s']:>7.1f} {1.0:>7.2f} {'-':>7} {f'(top-{top_k})':>15} {'-':>14} "
          f"{plain['misses_per_token_layer']:>13.2f}")
    for k in (1, 2, 4, 6, 8):
        r = run(pack, k, args.tokens)
        print(f"{k:>3} {r['tok_s']:>7.1f} {r['tok_s'] / plain['tok_s']:>7.2f} {r['acceptance']:>7.2f} "
              f"{r['experts_per_layer_window']:>15.1f} {r['misses_per_layer_window']:>14.1f} "
              f"{r['misses_per_token_layer']:>13.2f}", flush=True)


if __name__ == "__main__":
    main()

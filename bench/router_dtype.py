"""A decode token's routers on the host, held in fp32 or in bf16 (models/layers.py Weights.router:
a bf16 checkpoint's routers on the cpu device): the time a token spends in the native router of
every MoE layer of a real config, each layer's router its own matrix (read from memory, as a
decode step reads them), the two alternated. Beside it, what the token's routed and shared
experts read at Q4_K (4.5 bits a weight) for scale. Not a test.

    .venv/bin/python bench/router_dtype.py [--config ../shared/configs/qwen3.6-35b-a3b.json]
                                           [--threads 2] [--tokens 200] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from moefit import kernels  # noqa: E402
from moefit.kernels import rows  # noqa: E402


def shape(config: Path) -> dict:
    raw = json.loads(config.read_text())
    t = raw.get("text_config", raw)
    experts = t.get("num_experts") or t.get("n_routed_experts") or t.get("num_local_experts")
    inter = t.get("moe_intermediate_size") or t["intermediate_size"]
    shared = t.get("shared_expert_intermediate_size") or inter * (t.get("n_shared_experts") or 0)
    return {"hidden": t["hidden_size"], "experts": experts, "top_k": t.get("num_experts_per_tok") or t["experts_per_token"],
            "layers": t["num_hidden_layers"] - (t.get("first_k_dense_replace") or 0), "inter": inter, "shared": shared}


def token_time(routers: list[torch.Tensor], x: torch.Tensor, k: int, tokens: int) -> float:
    """Seconds a token: every layer's router once, in layer order."""
    t0 = time.perf_counter()
    for _ in range(tokens):
        for w in routers:
            rows.softmax_topk(x, w, k, True)
    return (time.perf_counter() - t0) / tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=ROOT.parent / "shared/configs/qwen3.6-35b-a3b.json")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if kernels.library() is None:
        sys.exit("the native kernels are not built")
    kernels.set_threads(args.threads)
    s = shape(args.config)
    g = torch.Generator().manual_seed(1)
    narrow = [torch.randn(s["experts"], s["hidden"], generator=g).to(torch.bfloat16) for _ in range(s["layers"])]
    wide = [w.float() for w in narrow]
    x = torch.randn(1, s["hidden"], generator=g)
    assert all(torch.equal(rows.softmax_topk(x, a, s["top_k"], True)[1], rows.softmax_topk(x, b, s["top_k"], True)[1])
               for a, b in zip(narrow, wide))
    expert_bytes = s["layers"] * (s["top_k"] * 3 * s["inter"] + 3 * s["shared"]) * s["hidden"] * 4.5 / 8
    print(f"{args.config.name}: {s['layers']} MoE layers, router {s['experts']} x {s['hidden']}, top-{s['top_k']}; "
          f"{args.threads} threads, isa {kernels.isa()}; the token's experts at Q4_K: {expert_bytes / 2**20:.0f} MiB")
    best = {"fp32": float("inf"), "bf16": float("inf")}
    for r in range(args.rounds):
        for name, routers in (("fp32", wide), ("bf16", narrow)):
            sec = token_time(routers, x, s["top_k"], args.tokens)
            best[name] = min(best[name], sec)
            size = sum(w.nbytes for w in routers)
            print(f"  round {r + 1} {name}: {sec * 1e3:.2f} ms a token routing, {size / 2**20:.0f} MiB read "
                  f"({size / sec / 1e9:.1f} GB/s; {size / (size + expert_bytes) * 100:.1f} % of the token's MoE bytes)")
    print(f"best of each: bf16 {best['bf16'] * 1e3:.2f} ms against fp32 {best['fp32'] * 1e3:.2f} "
          f"({best['fp32'] / best['bf16']:.2f}x, {(best['fp32'] - best['bf16']) * 1e3:.2f} ms a token less)")
    kernels.set_threads(kernels.default_threads())


if __name__ == "__main__":
    main()

"""The host MoE kernel alone: one layer call (top-k experts of T tokens) at a real expert
shape, over many distinct experts so that weights come from memory, not the cache. Not a test.

    .venv/bin/python bench/kernel.py [--hidden 2048] [--inter 768] [--experts 256] [--threads 1 2]
                                     [--quants int8 int4 q4_k q4_k/q6_k] [--tokens 1]

GGUF block types (q4_k, q5_k, q6_k, iq4_xs, mxfp4, or gate_up/down pairs as a Q4_K_M file mixes
them) are random blocks with small fp16 scales (tests/gguf_writer.py's). With --tokens > 1 every
expert takes all T tokens (a prefill chunk): the figure is then weight rows times tokens a second.
int4p: int4 experts held in the kernel's panel order (experts/host_panels.py), timed beside int4 in rows
(the pack's order, rearranged per call) on the same random weights; only where the body takes them.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from moefit import kernels  # noqa: E402
from moefit.pack.layout import GGUF_BLOCKS, matrix_quants  # noqa: E402
from moefit.pack.quant import quantize  # noqa: E402


def matrix(quant: str, rows: int, cols: int, g: torch.Generator) -> list[torch.Tensor]:
    if quant in GGUF_BLOCKS:
        import gguf
        from gguf_writer import super_blocks
        qtype = getattr(gguf.GGMLQuantizationType, quant.upper())
        return [torch.from_numpy(super_blocks((rows, cols), qtype, int(torch.randint(1 << 30, (1,), generator=g))))]
    return quantize(torch.randn(rows, cols, generator=g), quant, 32)


def experts(n: int, hidden: int, inter: int, quant: str) -> list[dict]:
    if quant == "int4p":
        return [in_panels(p) for p in experts(n, hidden, inter, "int4")]
    g = torch.Generator().manual_seed(0)
    gate_up, down = matrix_quants(quant)
    out = []
    for _ in range(n):
        p = dict(zip(["gate_up", "gate_up.scale"], matrix(gate_up, 2 * inter, hidden, g)))
        p.update(zip(["down", "down.scale"], matrix(down, hidden, inter, g)))
        out.append(p)
    return out


def in_panels(p: dict) -> dict:
    out = {}
    for m in ("gate_up", "down"):
        out[m], out[m + ".scale"] = kernels.rows_to_panels(p[m], p[m + ".scale"])
    return out


def nbytes(p: dict) -> int:
    return sum(t.nbytes for t in p.values())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--quants", nargs="+", default=["int8", "int4", "int4p"])
    args = ap.parse_args()
    print(f"isa {kernels.isa()}; hidden {args.hidden}, expert {args.inter}, top-{args.top_k}, "
          f"{args.tokens} token(s), {args.experts} distinct experts")
    for quant in args.quants:
        if quant == "int4p" and not kernels.int4_panels():
            print("int4p: this CPU's int4 body reads rows (no panels)")
            continue
        ex = experts(args.experts, args.hidden, args.inter, quant)
        panels = [quant == "int4p"] * args.top_k
        total = sum(nbytes(p) for p in ex)
        x = torch.randn(args.tokens, args.hidden)
        rows = [torch.arange(args.tokens)] * args.top_k
        w = [torch.full((args.tokens,), 1.0 / args.top_k)] * args.top_k
        for threads in args.threads:
            kernels.set_threads(threads)
            calls = args.experts // args.top_k
            best = float("inf")
            for _ in range(3):                               # a warm-up pass, the best of the others
                t0 = time.perf_counter()
                for c in range(calls):
                    kernels.moe_layer(x, quant.rstrip("p"), ex[c * args.top_k:(c + 1) * args.top_k], rows, w, panels)
                dt = time.perf_counter() - t0
                best = min(best, dt) if _ else best
            per_token = f", {best / calls / args.tokens * 1e6:.0f} us a token" if args.tokens > 1 else ""
            print(f"{quant} {threads} thread(s): {best / calls * 1e3:.3f} ms a layer call{per_token}, "
                  f"{total / best / 1e9:.1f} GB/s of expert weights ({total / 2**20:.0f} MiB read)")
    kernels.set_threads(kernels.default_threads())


if __name__ == "__main__":
    main()

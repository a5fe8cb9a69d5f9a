"""One layer's decode attention over a long stored context on the host: kernels/kv.h reading the
rows as stored, against the torch route it replaced (the rows decoded into fp32, then torch's
SDPA / flash kernel), in one run. Not a test.

    .venv/bin/python bench/kv_attention.py [--keys 4096,16384,32768] [--threads 2] [--out FILE] [--mla]

Shape: Qwen3-30B-A3B's attention (32 query heads, 4 KV heads of 128) and Qwen3.6-35B-A3B's
full-attention layers (16 / 2 of 256); one token (8 query rows a KV head) and a verify window of
4 (32 rows). Each KV dtype is timed as a whole cache (a decode step: models/attention.attend_state)
and as KV streaming's host part alone (all but the last 2,048 positions, what the host computes
while the card attends its ring: attention.attend_parts on that part). The torch route is timed
with the native kernels declined (attend_stored and attend_one return None). Best of --repeat
calls; GB/s counts the stored bytes read once.

MLA (GLM-4.7-Flash's 20 heads, DeepSeek-V3's 128, on a latent of 512 and a rope key of 64): a
decode step in the latent (models/attention.attend_latent, kernels/kv.h's moe_attend_latent)
against the torch route it replaced (both stores decoded, concatenated into keys, SDPA).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moefit import kernels  # noqa: E402
from moefit.families.state import AttentionKV, LatentKV  # noqa: E402
from moefit.kernels import rows  # noqa: E402
from moefit.memory.devices import open_device  # noqa: E402
from moefit.models.attention import attend_latent, attend_parts, attend_state  # noqa: E402
from moefit.runtime.placement import DeviceMemory  # noqa: E402
from moefit.runtime.state import AttentionState, SequenceState  # noqa: E402

SHAPES = {"qwen3-30b-a3b": (32, 4, 128), "qwen3.6-35b-a3b": (16, 2, 256)}
MLA_SHAPES = {"glm-4.7-flash": 20, "deepseek-v3": 128}                 # query heads on a latent of 512 + 64
KV_DTYPES = ("fp32", "bf16", "int8", "q4")
RESIDENT = 2048


def best_ms(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def filled(kv_heads: int, d: int, keys: int, kv_dtype: str, resident: int | None) -> SequenceState:
    """One attention layer's state, its `keys` positions written in prompt chunks of 512."""
    state = SequenceState(SimpleNamespace(sliding_window=None), keys, kv_dtype, torch.float32,
                          DeviceMemory(open_device("cpu")), 512, resident, decls=[AttentionKV(kv_heads, d, d)])
    g = torch.Generator().manual_seed(0)
    for start in range(0, keys, 512):
        n = min(512, keys - start)
        state.write(0, start, torch.randn(kv_heads, n, d, generator=g), torch.randn(kv_heads, n, d, generator=g))
    return state


def attention(state: SequenceState, heads: int, d: int, keys: int, tokens: int, resident: int | None):
    """The call timed: a decode step (or verify window) over the whole cache, or the host part alone."""
    q = torch.randn(heads, tokens, d)
    start = keys - tokens
    if resident is None:
        mask = None if tokens == 1 else torch.ones(tokens, keys).tril(start).bool()
        return lambda: attend_state(state, 0, q, start, mask)
    host = state.parts(0, keys, stored=True)[0]
    assert host[2] is not None and int(host[2].max()) < start          # the host part: every row attended
    return lambda: attend_parts(q, [host], torch.arange(start, keys), None)


def stored_bytes(layer: AttentionState, keys: int) -> int:
    stores = layer.host if layer.host else (layer.k, layer.v)
    return sum(t[:, :keys].nbytes for store in stores for t in store.values())


def run(args) -> None:
    print("shape              keys   tokens  kv     part    moefit ms   GB/s   torch ms  moefit/torch speed")
    real, real_one = rows.attend_stored, rows.attend_one
    for name, (heads, kv_heads, d) in SHAPES.items():
        for keys in args.keys:
            for kv_dtype in KV_DTYPES:
                for resident in (None, RESIDENT) if keys > RESIDENT else (None,):
                    state = filled(kv_heads, d, keys, kv_dtype, resident)
                    for tokens in (1, 4):
                        step = attention(state, heads, d, keys, tokens, resident)
                        rows.attend_stored, rows.attend_one = real, real_one
                        ours = best_ms(step, args.repeat)
                        rows.attend_stored = rows.attend_one = lambda *a, **kw: None
                        theirs = best_ms(step, max(2, args.repeat // 3))
                        rows.attend_stored, rows.attend_one = real, real_one
                        host = keys - RESIDENT if resident else keys
                        gbs = stored_bytes(state.layers[0], host) / ours / 1e6
                        part = "host" if resident else "whole"
                        print(f"{name:17} {keys:6} {tokens:6}   {kv_dtype:5} {part:6} {ours:10.2f} {gbs:6.1f} "
                              f"{theirs:10.2f}  {theirs / ours:6.1f}x", flush=True)


def run_latent(args) -> None:
    print("shape              keys   tokens  kv     part    moefit ms   GB/s   torch ms  moefit/torch speed")
    for name, heads in MLA_SHAPES.items():
        for keys in args.keys:
            for kv_dtype in ("fp32", "bf16", "int8"):
                state = SequenceState(SimpleNamespace(sliding_window=None), keys, kv_dtype, torch.float32,
                                      DeviceMemory(open_device("cpu")), 512, decls=[LatentKV(512, 64)])
                g = torch.Generator().manual_seed(0)
                for start in range(0, keys, 512):
                    n = min(512, keys - start)
                    state.write(0, start, torch.randn(1, n, 64, generator=g), torch.randn(1, n, 512, generator=g))
                q = torch.randn(heads, 1, 512 + 64)
                ours = best_ms(lambda: attend_latent(state, 0, q, keys - 1, 0.1), args.repeat)
                theirs = best_ms(lambda: attend_state(state, 0, q, keys - 1, None, scale=0.1,
                                                      keys=lambda k_r, c: (torch.cat((c, k_r), -1), c)),
                                 max(2, args.repeat // 3))
                gbs = stored_bytes(state.layers[0], keys) / ours / 1e6
                print(f"{name:17} {keys:6} {1:6}   {kv_dtype:5} {'whole':6} {ours:10.2f} {gbs:6.1f} "
                      f"{theirs:10.2f}  {theirs / ours:6.1f}x", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", default="4096,16384,32768", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--mla", action="store_true", help="MLA's latent attention only")
    args = ap.parse_args()
    if args.out:
        sys.stdout = open(args.out, "w", buffering=1)  # noqa: SIM115
    torch.set_num_threads(args.threads)
    kernels.set_threads(args.threads)
    print(f"# {platform.processor() or platform.machine()}, {args.threads} threads, kernel isa {kernels.isa()}, "
          f"torch {torch.__version__}")
    (run_latent if args.mla else run)(args)


if __name__ == "__main__":
    main()

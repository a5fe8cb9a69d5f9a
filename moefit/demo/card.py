"""Make the demo's simulated card: a 12 GB-class card scaled down to the demo model. The
desktop holds the seed's baseline share of it, and after the dense weights, the resident
window of the KV cache (--kv-resident) and the reserve, about a quarter of the experts fit.
Its allocator model is exact: CUDA's 2 MiB and 20 MiB segments do not scale down.

    python -m moefit.demo.card        # rewrites moefit/demo/card.json
"""

from __future__ import annotations

from moefit.demo import CARD, SEED_DESKTOP, SEED_TOTAL_MIB, demo_pack, sim_flag as flag
from moefit.memory.footprint import from_pack_header
from moefit.memory.simcard import write_card
from moefit.pack.format import read_header

MIB = 1 << 20


def main() -> None:
    header = read_header(demo_pack())
    fp = from_pack_header(header, "fp32")
    ctx, resident = int(flag("--ctx")), int(flag("--kv-resident"))
    chunk = int(flag("--prefill-chunk"))
    moefit = (fp.dense_bytes + fp.probe_bytes + fp.rope_bytes(ctx) + fp.state_bytes(ctx, "fp32", chunk, resident)
              + flag("--vram-reserve-mib") * MIB + sum(sorted(fp.blob_sizes.values())[: len(fp.blob_sizes) // 4]))
    desktop_share = sum(m for _, _, m in SEED_DESKTOP) / SEED_TOTAL_MIB
    total = (moefit + 16 * 1024) / (1 - desktop_share) / MIB            # a few KiB of slack
    scale = total / SEED_TOTAL_MIB
    procs = [(pid, name, round(mib * scale, 4)) for pid, name, mib in SEED_DESKTOP]
    write_card(CARD, f"RTX 4070 12 GB (simulated, scaled 1:{1 / scale:.0f} to the demo model)", round(total, 4), procs,
               allocator="exact")      # scaled 1:480: a 2 MiB CUDA segment would be 8 % of it
    print(f"wrote {CARD}: {total:.2f} MiB, desktop {sum(p[2] for p in procs):.2f} MiB; {ctx} tokens of context, {resident} on the card")


if __name__ == "__main__":
    main()

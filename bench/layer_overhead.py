"""What a decode layer costs the engine thread beyond its weights: a model of a real config's
topology (its layers, experts, top-k, attention heads) with every width shrunk so that the
weights are noise (hidden 256, experts and a shared expert of 64, heads of 64, 2 of them for
Gated DeltaNet's keys and 4 for its values, a 2,048-token vocabulary), decoded on the host;
the time a token over the layers is then the Python and the native calls' fixed costs a layer.
Not a test.

    .venv/bin/python bench/layer_overhead.py [--config ../shared/configs/qwen3-30b-a3b.json]
                                             [--threads 2] [--repeats 3] [--tree DIR]

--tree runs another checkout's moefit on the same pack (an A/B: a process each, alternated by the
caller). Prompt 64 random ids, 64 new at the routing-spread temperature, --dense-quant int4.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
SHRUNK = {"hidden_size": 256, "moe_intermediate_size": 64, "intermediate_size": 512, "vocab_size": 2048,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "shared_expert_intermediate_size": 64,
          "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 64,
          "linear_value_head_dim": 64}


def shrunk_config(config: Path, out: Path) -> Path:
    raw = json.loads(config.read_text())
    raw.get("text_config", raw).update(SHRUNK)
    out.write_text(json.dumps(raw))
    return out


def decode_rate(tree: Path, pack: Path, threads: int) -> float:
    """Tokens a second, in a process running `tree`'s moefit: its bench/decode.py's own row
    (time_moefit: 64 new tokens at the routing-spread temperature after 64 random ids)."""
    prompt = torch.randint(2048, (64,), generator=torch.Generator().manual_seed(1)).tolist()
    row = json.dumps({"fn": "time_moefit", "args": [str(pack), prompt, 64, threads, "int4"], "threads": threads})
    out = subprocess.run([sys.executable, str(tree / "bench/decode.py"), "--row", row], cwd=tree, capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["decode_tok_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=ROOT.parent / "shared/configs/qwen3-30b-a3b.json")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tree", type=Path, default=ROOT)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "bench"))
    from synthetic_pack import build_pack
    with tempfile.TemporaryDirectory() as tmp:
        cfg = shrunk_config(args.config, Path(tmp) / "config.json")
        pack = build_pack(cfg, Path(tmp) / "pack")
        from moefit.config import ModelConfig
        layers = ModelConfig.from_hf(json.loads(cfg.read_text())).num_layers
        print(f"{args.config.name}'s topology, widths shrunk ({layers} layers), dense int4, {args.threads} threads, "
              f"tree {args.tree}")
        for _ in range(args.repeats):
            rate = decode_rate(args.tree, pack, args.threads)
            print(f"  decode {rate:.1f} tok/s: {1e6 / rate / layers:.0f} us a layer, {1e3 / rate:.2f} ms a token")


if __name__ == "__main__":
    main()

"""Write the demo's expert profile (moefit/demo/profile.json) and look-ahead probe
(moefit/demo/probe.bin, probe.json) from its training corpus.

    apt-get install wordnet-base        # the corpus tools/train_demo.py trained on
    .venv/bin/python tools/profile_demo.py [--documents 400]

The profile is routing counts per (layer, expert) over a fixed sample of the training
documents (never the prompts the demo will be asked), read through the int8 demo pack that
`make run` serves; the probe (experts/probe.py) is fitted on the same documents, every fifth
held out to score it. `make run` copies both into the pack, so the demo never serves blind.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from moefit.config import ServeConfig  # noqa: E402
from moefit.demo import PROBE, PROBE_SECTION, PROFILE, demo_pack  # noqa: E402
from moefit.experts.probe import PROBE_FILE, ProbeFit, save  # noqa: E402
from moefit.experts.profile import Profile  # noqa: E402
from moefit.pack.format import HEADER  # noqa: E402
from moefit.runtime.engine import Engine  # noqa: E402
from train_demo import documents  # noqa: E402

SEED = 1234                      # train_demo.py's: the same documents and the same split


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--documents", type=int, default=400)
    args = ap.parse_args()
    docs = documents(SEED)
    train = docs[len(docs) // 50:]                        # train_demo.py keeps the first 2 % for validation
    sample = random.Random(0).sample(train, args.documents)
    engine = Engine.open(demo_pack(), ServeConfig(ctx=512, prefill_chunk=512))
    m = engine.pack.model
    engine.runner.profile = Profile.empty(m.num_layers, m.num_experts)
    fit = engine.loaded.model.probe_fit = ProbeFit(m.top_k)
    for n, doc in enumerate(sample):
        fit.begin(n)
        engine.kv_tokens = []
        engine.prefill(engine.codec.encode(doc)[:511])
    engine.runner.profile.save(PROFILE)
    skew = ", ".join(f"{s:.2f}" for s in engine.runner.profile.skew() if s)
    print(f"wrote {PROFILE}: {args.documents} training documents; top quarter's share per layer: {skew}")
    fitted = fit.fit(engine.loaded.model)
    save(engine.pack.path, fitted, args.documents)
    PROBE.write_bytes((engine.pack.path / PROBE_FILE).read_bytes())
    section = json.loads((engine.pack.path / HEADER).read_text())["probe"]
    PROBE_SECTION.write_text(json.dumps(section, indent=1) + "\n")
    recalls = [f"{fitted.router_recall[j]:.3f} -> {fitted.probe_recall[j]:.3f}" for j in sorted(fitted.matrices)]
    print(f"wrote {PROBE}: held-out recall per layer, router -> probe: {', '.join(recalls)}")


if __name__ == "__main__":
    main()

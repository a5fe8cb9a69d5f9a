import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import tiny  # noqa: E402

FAMILIES = ("qwen3_moe", "mixtral", "olmoe")


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """family -> a tiny random HF checkpoint directory."""
    root = tmp_path_factory.mktemp("hf")
    return {f: tiny.build_checkpoint(f, root / f, seed=i) for i, f in enumerate(FAMILIES)}


@pytest.fixture(scope="session")
def packs(checkpoints, tmp_path_factory):
    """(family, quant) -> a pack directory, built on first use."""
    from moefit.pack.convert import convert
    root = tmp_path_factory.mktemp("packs")
    made = {}

    def get(family: str, quant: str = "fp32") -> Path:
        if (family, quant) not in made:
            made[(family, quant)] = root / f"{family}-{quant}"
            convert(checkpoints[family], made[(family, quant)], recipe=quant, progress=False)
        return made[(family, quant)]
    return get


@pytest.fixture
def card(tmp_path):
    """A simulated card file factory: card(total_mib, [(pid, name, mib), ...])."""
    from moefit.memory.simcard import write_card
    path = tmp_path / "card.json"

    def make(total_mib: float, processes=(), unattributed_mib: float = 0) -> Path:
        write_card(path, "Test card (simulated)", total_mib, list(processes), unattributed_mib)
        return path
    return make

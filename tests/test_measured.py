"""ops/measured.py: the host's measured choices (prompt products' ways, expert GEMM crossovers)
kept in the state directory and taken by the next start on the same host."""

import json

import pytest
import torch

from moefit import kernels
from moefit.config import ServeConfig
from moefit.kernels import gemm
from moefit.ops import measured
from moefit.ops.startup import StartOptions, start_engine


class Rates:
    def __init__(self, setting="auto", crossovers=None):
        self.setting, self.crossovers = setting, dict(crossovers or {})


def test_kept_choices_come_back_on_the_same_host_only(tmp_path, monkeypatch):
    monkeypatch.setattr(gemm, "_way_for", {(128, "int4", 2048, 12352): "dots", (512, "fp32", 512, 2048): "onednn"})
    measured.keep(tmp_path, Rates(crossovers={"int4": 10 ** 9, "q4_k": 48}))
    monkeypatch.setattr(gemm, "_way_for", {})
    rates = Rates()
    assert measured.restore(tmp_path, rates) == 4
    assert gemm._way_for == {(128, "int4", 2048, 12352): "dots", (512, "fp32", 512, 2048): "onednn"}
    assert rates.crossovers == {"int4": 10 ** 9, "q4_k": 48}
    fixed = Rates(setting="24")                                  # a crossover given on the command line wins
    assert measured.restore(tmp_path, fixed) == 2 and fixed.crossovers == {}
    monkeypatch.setattr(measured, "host_key", lambda: "another CPU | 2 threads")
    monkeypatch.setattr(gemm, "_way_for", {})
    assert measured.restore(tmp_path, Rates()) == 0 and gemm._way_for == {}
    measured.keep(tmp_path, Rates())                             # another host's entry is added, ours kept
    assert len(json.loads((tmp_path / measured.FILE).read_text())) == 2


@pytest.mark.parametrize("text", ["not json", "[]", '{"%s": {"ways": [[1]]}}', '{"%s": 3}'])
def test_a_damaged_file_measures_afresh(text, tmp_path, monkeypatch):
    monkeypatch.setattr(gemm, "_way_for", {})
    (tmp_path / measured.FILE).write_text(text.replace("%s", measured.host_key()))
    assert measured.restore(tmp_path, Rates()) == 0 and gemm._way_for == {}
    measured.keep(tmp_path / measured.FILE / "below a file", Rates())     # unwritable: skipped, no error


def test_a_second_start_prompts_without_timing_again(packs, tmp_path, monkeypatch):
    """A start keeps what its first prompt measured (Start.finish); the next start on this host
    takes it before any request, and its prompt runs the same ways without timing them."""
    from moefit.pack import quant as q
    if kernels.library() is None:
        pytest.skip("the native kernel is not built")
    monkeypatch.setattr(gemm, "_way_for", {})
    timed = []
    real = gemm._measure
    monkeypatch.setattr(gemm, "_measure", lambda *a: timed.append(1) or real(*a))
    opts = StartOptions(tmp_path / "state")
    cfg = ServeConfig(ctx=256, dense_quant="int4")
    prompt = [(7 * i) % 300 + 3 for i in range(q.GEMM_TOKENS + 4)]
    engine, start = start_engine(packs("qwen3_moe", "int4"), cfg, opts, say=lambda *_: None)
    engine.prefill(prompt)
    start.finish(engine)
    first = dict(gemm._way_for)
    assert timed and first and engine.runner.rates.crossovers
    monkeypatch.setattr(gemm, "_way_for", {})
    said = []
    engine, _ = start_engine(packs("qwen3_moe", "int4"), cfg, opts, say=said.append)
    assert gemm._way_for == first and "kept from an earlier start" in said[-1]
    timed.clear()
    logits, _ = engine.prefill(prompt)
    assert not timed and torch.isfinite(logits).all()

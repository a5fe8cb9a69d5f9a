"""A router held in bf16 on the host (models/layers.py Weights.router): where the model computes
in fp32 on the cpu device and a router's values are all bf16's (a bf16 checkpoint's), it is kept
in bf16 and the native routers widen each value as they read it (kernels/rows.h): the same
logits, so the same routing and tokens as the fp32 copy, for half its bytes."""

from __future__ import annotations

import pytest
import torch

from moefit import kernels
from moefit.kernels import rows

pytestmark = pytest.mark.skipif(kernels.library() is None, reason="the native kernels are not built")


def _router(n: int, e: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (2 * torch.randn(n, e, generator=g)).to(torch.bfloat16)


@pytest.mark.parametrize("tokens", [1, 5])
def test_a_bf16_router_gives_the_bits_of_its_fp32_copy(tokens):
    """softmax_topk (with and without a bias) and sigmoid_topk: ids and weights bit for bit those
    of the router widened to fp32, for widths that end inside a vector's chunk of four."""
    g = torch.Generator().manual_seed(3)
    for e in (64, 80, 2048):
        w = _router(48, e, e)
        x, bias = torch.randn(tokens, e, generator=g), torch.randn(48, generator=g)
        for b in (None, bias):
            narrow, wide = rows.softmax_topk(x, w, 6, True, b), rows.softmax_topk(x, w.float(), 6, True, b)
            assert torch.equal(narrow[0], wide[0]) and torch.equal(narrow[1], wide[1])
        narrow = rows.sigmoid_topk(x, w, bias, 6, 4, 2, True, 2.5)
        wide = rows.sigmoid_topk(x, w.float(), bias, 6, 4, 2, True, 2.5)
        assert torch.equal(narrow[0], wide[0]) and torch.equal(narrow[1], wide[1])


def test_a_router_not_exact_in_bf16_stays_fp32():
    from moefit.models.layers import Weights
    exact, inexact = _router(8, 32, 1).float(), torch.randn(8, 32)
    tensors = {"exact": exact, "inexact": inexact}
    placed = Weights(list(tensors), tensors.__getitem__, lambda name, t, keep=False: t, narrow_routers=True)
    assert placed.router("exact").dtype is torch.bfloat16 and torch.equal(placed.router("exact").float(), exact)
    assert placed.router("inexact").dtype is torch.float32
    off = Weights(list(tensors), tensors.__getitem__, lambda name, t, keep=False: t)
    assert off.router("exact").dtype is torch.float32


@pytest.fixture(scope="module")
def bf16_packs(tmp_path_factory):
    """family -> an int8 pack of a tiny bf16 checkpoint."""
    import tiny
    from moefit.pack.convert import convert
    root, made = tmp_path_factory.mktemp("bf16"), {}

    def get(family: str):
        if family not in made:
            hf = tiny.build_checkpoint(family, root / f"hf-{family}", seed=2, dtype=torch.bfloat16)
            made[family] = root / family
            convert(hf, made[family], recipe="int8", progress=False)
        return made[family]
    return get


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe", "glm4_moe", "gpt_oss"])
def test_a_bf16_checkpoints_routers_are_bf16_on_the_cpu_with_the_same_tokens(bf16_packs, family, monkeypatch):
    """--device cpu: every MoE layer's router is held in bf16; the greedy tokens and the last
    hidden state are bit for bit those of the routers held in fp32 (softmax, Qwen3.5's, DeepSeek /
    GLM's grouped sigmoid, gpt-oss's biased softmax), with the dense matrices quantised (the
    decode step routed in the experts' call) and not."""
    from moefit.config import ServeConfig
    from moefit.models import layers
    from moefit.runtime.engine import Engine
    from moefit.runtime.sampler import SamplingParams
    params, prompt = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), [5, 17, 42, 99, 7, 3]
    for dense in ("off", "int8"):
        cfg = ServeConfig(ctx=64, dense_quant=dense)
        e = Engine.open(bf16_packs(family), cfg)
        routers = [layer["router"] for layer in e.model.layers if "router" in layer]
        assert routers and all(r.dtype is torch.bfloat16 for r in routers)
        tokens, hidden = e.generate(prompt, params)[1].generated, e.last_hidden.clone()
        with monkeypatch.context() as m:
            m.setattr(layers.Weights, "router", layers.Weights.get)
            wide = Engine.open(bf16_packs(family), cfg)
            assert all(layer["router"].dtype is torch.float32 for layer in wide.model.layers if "router" in layer)
            assert wide.generate(prompt, params)[1].generated == tokens
            assert torch.equal(wide.last_hidden, hidden)


def test_torchs_routers_widen_a_bf16_router(monkeypatch):
    """Without the native routers (no library, or host calls off on a recorded piece's thread),
    the families' softmax and sigmoid routers take a bf16 matrix as its fp32 copy."""
    from moefit.models import layers
    monkeypatch.setattr(rows, "_fn", lambda name: None)
    g = torch.Generator().manual_seed(4)
    w, x, bias = _router(32, 64, 9), torch.randn(3, 64, generator=g), torch.randn(32, generator=g)
    for narrow, wide in [(layers.softmax_topk(x, w, 4, True), layers.softmax_topk(x, w.float(), 4, True)),
                         (layers.sigmoid_router(x, w, bias, 4, 4, 2, True, 1.5),
                          layers.sigmoid_router(x, w.float(), bias, 4, 4, 2, True, 1.5))]:
        assert torch.equal(narrow[0], wide[0]) and torch.equal(narrow[1], wide[1])

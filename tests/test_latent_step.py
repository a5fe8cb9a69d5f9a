"""MLA's decode step in one native call (kernels/mla.h, DeepseekV3.latent_step) against the same
layer computed op by op: the same logits to fp32 rounding and the same stored rows, for
DeepSeek-V3 and GLM-4.7-Flash with their matrices quantised (--dense-quant: kv_b head by head),
with and without a query rank, on fp32, int8 and q4 rows; the layers it must leave to the op-by-op
path; and the sigmoid router's native call."""

import pytest
import torch

from moefit import kernels
from moefit.config import ServeConfig
from moefit.kernels.latent import LatentStep
from moefit.models.deepseek_v3 import DeepseekV3
from moefit.pack.convert import convert
from moefit.runtime.engine import Engine

import tiny
from step_calls import step_calls

pytestmark = pytest.mark.skipif(kernels.library() is None, reason="the native kernel is not built")
PROMPT = [5, 9, 13, 2, 7, 11, 3, 8, 21, 4]
FORCED = [6, 17, 2, 9, 30, 12, 1]
DIMS = dict(qk_rope_head_dim=16, kv_lora_rank=32, q_lora_rank=64, qk_nope_head_dim=32, v_head_dim=32)  # the kernel takes these


def decode(engine: Engine) -> torch.Tensor:
    engine.kv_tokens = []
    engine.prefill(PROMPT)
    return torch.stack([engine.decode_step(t, len(PROMPT) + i) for i, t in enumerate(FORCED)])


def computed(monkeypatch, blocks: list | None = None) -> list:
    return step_calls(monkeypatch, LatentStep, blocks)


def stored(engine: Engine, layer: int) -> list[torch.Tensor]:
    k, v = engine.loaded.kv.layers[layer].k, engine.loaded.kv.layers[layer].v
    n = len(PROMPT) + len(FORCED)
    return [t[:, :n].clone() for store in (k, v) for t in store.values()]


def open_pack(tmp_path, family: str, **over) -> tuple:
    hf = tiny.build_checkpoint(family, tmp_path / "hf", **(DIMS | over))
    convert(hf, tmp_path / "pack", "int8", progress=False)
    return lambda **cfg: Engine.open(tmp_path / "pack", ServeConfig(ctx=64, **cfg))


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe_lite"])
@pytest.mark.parametrize("dense", ["int8", "int4"])
@pytest.mark.parametrize("kv_dtype", ["fp32", "int8", "q4", "k8v4", "bf16"])
def test_one_call_gives_the_op_by_op_logits_and_rows(family, dense, kv_dtype, tmp_path, monkeypatch):
    """q4 (and k8v4's q4 latents): rows written turned, the query turned into each store's space
    and the latent output turned back, in the one call as op by op (rope keys of 32: q4's groups)."""
    over = dict(qk_rope_head_dim=32) if kv_dtype == "q4" else {}
    engine = open_pack(tmp_path, family, **over)(dense_quant=dense, kv_dtype=kv_dtype)
    calls = computed(monkeypatch)
    native = decode(engine)
    assert len(calls) == len(FORCED) * engine.model.cfg.num_layers and all(c is not None for c in calls)
    rows = stored(engine, 1)
    monkeypatch.setattr(DeepseekV3, "latent_step", lambda *a, **k: None)
    ops = decode(engine)
    assert float((native - ops).abs().max() / ops.abs().max()) < 1e-5
    for got, want in zip(rows, stored(engine, 1)):
        if got.dtype == torch.uint8:                         # q4: two codes a byte
            got, want = (torch.stack((t & 15, t >> 4), -1).to(torch.int8) for t in (got, want))
        if got.dtype == torch.int8:                          # a code may round the other way at a half
            assert int((got.int() - want.int()).abs().max()) <= 1 and float((got != want).float().mean()) < 0.01
        else:
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe_lite"])
@pytest.mark.parametrize("dense", ["int8", "int4"])
def test_an_mla_step_is_a_block_with_the_separate_calls_numbers(family, dense, tmp_path, monkeypatch):
    """Once an MLA layer's native step is made, a decode step's whole sublayer (both norms, o_proj
    and the residual) is its one call (mla.h's block): every layer takes it from the second step
    on, and the logits and stored rows equal those of the step between separate calls, bit for bit."""
    engine = open_pack(tmp_path, family)(dense_quant=dense)
    blocks = []
    calls = computed(monkeypatch, blocks)
    one_call = decode(engine)
    layers = engine.model.cfg.num_layers
    assert blocks == [False] * layers + [True] * (len(FORCED) - 1) * layers and all(c is not None for c in calls)
    rows = stored(engine, 1)
    monkeypatch.setattr(LatentStep, "_block_parts", lambda self, *a: (None, (None, None)))   # steps, not blocks
    engine.model.steps.clear()
    blocks.clear()
    assert torch.equal(one_call, decode(engine)) and not any(blocks)
    assert all(torch.equal(a, b) for a, b in zip(rows, stored(engine, 1)))


def test_without_a_query_rank(tmp_path, monkeypatch):
    """DeepSeek-V2-Lite's layout: the query projection reads the layer's input itself."""
    engine = open_pack(tmp_path, "deepseek_v3", q_lora_rank=None)(dense_quant="int8")
    calls = computed(monkeypatch)
    native = decode(engine)
    assert "q_a" not in engine.model.layers[0] and calls and all(c is not None for c in calls)
    monkeypatch.setattr(DeepseekV3, "latent_step", lambda *a, **k: None)
    ops = decode(engine)
    assert float((native - ops).abs().max() / ops.abs().max()) < 1e-5


@pytest.mark.parametrize("config", [dict(dense_quant="off"), dict(dense_quant="int8", kv_resident="16", prefill_chunk=8)])
def test_what_it_does_not_take_runs_op_by_op(config, tmp_path):
    """kv_b not quantised, a ring (KV
    streaming): no native step, the same greedy tokens as ever."""
    engine = open_pack(tmp_path, "glm4_moe_lite")(**config)
    decode(engine)
    assert not engine.model.steps


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe", "glm4_moe_lite"])
def test_the_sigmoid_router_runs_natively_with_torchs_choices(family, tmp_path, monkeypatch):
    """DeepSeek-V3's router (groups), GLM's (one group): every MoE layer routes in one native call
    (kernels/rows.h), a decode step's in the call that posts its experts too (posted.h), and the
    logits equal those of torch's router."""
    from moefit import kernels
    from moefit.kernels import rows
    from moefit.models import layers
    engine = open_pack(tmp_path, family)(dense_quant="int8")
    calls, real, steps, route_post = [], rows.sigmoid_topk, [], kernels.route_post
    monkeypatch.setattr(layers.native, "sigmoid_topk", lambda *a: calls.append(real(*a)) or calls[-1])
    monkeypatch.setattr(kernels, "route_post", lambda *a: steps.append(route_post(*a)) or steps[-1])
    native = decode(engine)
    moe_layers = sum("router" in layer for layer in engine.model.layers)
    assert moe_layers and len(calls) == moe_layers and len(steps) == moe_layers * len(FORCED)  # the prompt; each step
    assert all(c is not None for c in calls + steps)                             # each routed natively
    monkeypatch.setattr(layers.native, "sigmoid_topk", lambda *a: None)
    monkeypatch.setattr(type(engine.model), "native_router", None)              # the family's route: torch's
    ops = decode(engine)
    assert float((native - ops).abs().max() / ops.abs().max()) < 1e-5

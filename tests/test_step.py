"""A decode step's attention in one native call (kernels/step.h, DecoderModel.attention_step)
against the same layer computed op by op: the same logits and the same cache rows, for the
families that take it (Qwen3-MoE with QK-norm, Mixtral plain, GLM-4.5 with a bias and partial
RoPE) and Qwen3.5 / Next (gated heads); and the layers it must leave to the op-by-op path."""

import pytest
import torch

from moefit import kernels
from moefit.config import ServeConfig
from moefit.kernels import rows as native
from moefit.models.layers import DecoderModel
from moefit.pack.convert import convert
from moefit.runtime.engine import Engine

import tiny
from step_calls import step_calls

pytestmark = pytest.mark.skipif(kernels.library() is None, reason="the native kernel is not built")
PROMPT = [5, 9, 13, 2, 7, 11, 3, 8, 21, 4]
FORCED = [6, 17, 2, 9, 30]


def decode(engine: Engine) -> torch.Tensor:
    engine.kv_tokens = []
    engine.prefill(PROMPT)
    return torch.stack([engine.decode_step(t, len(PROMPT) + i) for i, t in enumerate(FORCED)])


def computed(monkeypatch, blocks: list | None = None) -> list:
    return step_calls(monkeypatch, native.AttentionStep, blocks)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "glm4_moe"])
@pytest.mark.parametrize("dense", ["int8", "int4"])
def test_one_call_gives_the_op_by_op_logits(family, dense, tmp_path, monkeypatch):
    """The one call, its output projection included (the sublayer's output comes back), gives the
    op-by-op path's logits and cache rows bit for bit."""
    hf = tiny.build_checkpoint(family, tmp_path / "hf", head_dim=32)            # a head dim the kernel takes
    convert(hf, tmp_path / "pack", "int8", progress=False)
    engine = Engine.open(tmp_path / "pack", ServeConfig(ctx=64, dense_quant=dense))
    blocks = []
    calls = computed(monkeypatch, blocks)
    one_call = decode(engine)
    layers = engine.model.cfg.num_layers
    assert len(calls) == len(FORCED) * layers and all(c is not None for c in calls)
    assert {tuple(c.shape) for c in calls} == {(1, engine.model.cfg.hidden_size)}
    assert all(step.projects and step.blocks for _, step in engine.model.steps.values())   # o and the norms in the call
    assert blocks == [False] * layers + [True] * (len(FORCED) - 1) * layers     # once made, the norms are in it too
    k_native = engine.loaded.kv.layers[0].k["x"][:, :len(PROMPT) + len(FORCED)].clone()
    monkeypatch.setattr(DecoderModel, "attention_step", lambda *a, **k: None)
    assert torch.equal(one_call, decode(engine))
    assert torch.equal(k_native, engine.loaded.kv.layers[0].k["x"][:, :len(PROMPT) + len(FORCED)])


@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe"])
def test_an_int8_cache_is_coded_and_read_in_the_one_call(family, tmp_path, monkeypatch):
    """--kv-dtype int8: the one call writes the row as kv_codecs' Int8Rows.put does (a scale of
    max|x| / 127, codes rounded half to even) and reads the codes in place (kv.h), as the op-by-op
    path does: the same codes, scales and logits."""
    hf = tiny.build_checkpoint(family, tmp_path / "hf", head_dim=32)
    convert(hf, tmp_path / "pack", "int8", progress=False)
    engine = Engine.open(tmp_path / "pack", ServeConfig(ctx=64, dense_quant="int8", kv_dtype="int8"))
    calls = computed(monkeypatch)
    one_call = decode(engine)
    assert len(calls) == len(FORCED) * engine.model.cfg.num_layers and all(c is not None for c in calls)
    held = len(PROMPT) + len(FORCED)
    stores = lambda: [t[:, :held].clone() for layer in engine.loaded.kv.layers  # noqa: E731
                      for store in (layer.k, layer.v) for t in (store["x"], store["s"])]
    native = stores()
    assert native[0].dtype == torch.int8
    monkeypatch.setattr(DecoderModel, "attention_step", lambda *a, **k: None)
    ops = decode(engine)
    assert all(torch.equal(a, b) for a, b in zip(native, stores()))
    assert float((one_call - ops).abs().max() / ops.abs().max()) < 1e-6


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
def test_gated_heads_take_it_in_a_hybrid_stack(family, tmp_path, monkeypatch):
    """Qwen3.5 / Next's full-attention layers (each head's query followed by its output gate,
    partial RoPE): every one takes the one call, the DeltaNet layers none, and the logits equal
    the op-by-op path's to fp32 rounding (the gate's sigmoid is C's expf there, torch's here)."""
    hf = tiny.build_checkpoint(family, tmp_path / "hf", head_dim=32)
    convert(hf, tmp_path / "pack", "int8", progress=False)
    engine = Engine.open(tmp_path / "pack", ServeConfig(ctx=64, dense_quant="int8"))
    calls = computed(monkeypatch)
    one_call = decode(engine)
    attention = [layer for layer in engine.model.layers if "linear" not in layer]
    assert sorted(map(id, attention)) == sorted(engine.model.steps)
    assert len(calls) == len(FORCED) * len(attention) and all(c is not None for c in calls)
    monkeypatch.setattr(DecoderModel, "attention_step", lambda *a, **k: None)
    ops = decode(engine)
    assert float((one_call - ops).abs().max() / ops.abs().max()) < 1e-5


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
@pytest.mark.parametrize("dense", ["int8", "int4"])
def test_a_deltanet_step_is_a_block_with_the_separate_calls_numbers(family, dense, tmp_path, monkeypatch):
    """Once a DeltaNet layer's native step is made, a decode step's whole sublayer (both norms, the
    residual, in_proj and out_proj) is its one call (kernels/delta.h's block): every DeltaNet layer
    takes it from the second step on, and the logits, recurrent states and conv windows equal
    those of the step between separate calls, bit for bit."""
    hf = tiny.build_checkpoint(family, tmp_path / "hf", head_dim=32)
    convert(hf, tmp_path / "pack", "int8", progress=False)
    engine = Engine.open(tmp_path / "pack", ServeConfig(ctx=64, dense_quant=dense))
    blocks, run = [], native.DeltaStep.block_run
    monkeypatch.setattr(native.DeltaStep, "block_run", lambda self, *a: blocks.append(run(self, *a)) or blocks[-1])
    one_call = decode(engine)
    deltanet = [layer for layer in engine.model.layers if "linear" in layer]
    assert deltanet and len(blocks) == (len(FORCED) - 1) * len(deltanet) and all(b is not None for b in blocks)
    states = lambda: [t.clone() for st in engine.loaded.kv.layers if hasattr(st, "conv") for t in (st.s, st.conv)]  # noqa: E731
    blocked = states()
    monkeypatch.setattr(native.DeltaStep, "_bind_block", lambda self, *a: None)       # steps that are not blocks
    engine.model.delta_native.clear()
    separate = decode(engine)
    assert len(blocks) == (len(FORCED) - 1) * len(deltanet)                            # none taken this time
    assert torch.equal(one_call, separate)
    assert all(torch.equal(a, b) for a, b in zip(blocked, states()))


@pytest.mark.parametrize("family,kv", [("qwen3_moe", "q4"), ("glm4_moe", "q4"), ("qwen3_moe", "k8v4"),
                                       ("qwen3_moe", "fp16"), ("glm4_moe", "bf16")])
def test_a_q4_or_16_bit_cache_is_coded_and_read_in_the_one_call(family, kv, tmp_path, monkeypatch):
    """--kv-dtype q4 (and int8 keys with q4 values; fp16 and bf16, rounded as torch rounds them): the one call writes the row with kv.h's writer,
    the one a prompt's rows go through on the host too (rotated, 4-bit codes, fp16 group scales),
    turns the query as the keys are and the output back: the same codes and scales as the op-by-op
    path, and its logits to fp32 rounding (the turns' sums are ordered differently)."""
    hf = tiny.build_checkpoint(family, tmp_path / "hf", head_dim=32)
    convert(hf, tmp_path / "pack", "int8", progress=False)
    engine = Engine.open(tmp_path / "pack", ServeConfig(ctx=64, dense_quant="int8", kv_dtype=kv))
    calls = computed(monkeypatch)
    one_call = decode(engine)
    assert len(calls) == len(FORCED) * engine.model.cfg.num_layers and all(c is not None for c in calls)
    held = len(PROMPT) + len(FORCED)
    stores = lambda: [t[:, :held].clone() for layer in engine.loaded.kv.layers  # noqa: E731
                      for store in (layer.k, layer.v) for t in store.values()]
    native_rows = stores()
    values = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(kv, torch.uint8)          # or q4's codes
    assert engine.loaded.kv.layers[0].v["x"].dtype == values
    monkeypatch.setattr(DecoderModel, "attention_step", lambda *a, **k: None)
    ops = decode(engine)
    assert all(torch.equal(a, b) for a, b in zip(native_rows, stores()))
    assert float((one_call - ops).abs().max() / ops.abs().max()) < 1e-5


def test_the_host_writes_q4_rows_as_torch_codes_them():
    """kv.h's q4 writer (a host write of one position, a step's op by op) against kv_codecs' torch coding of the
    same rows: the same fp16 scales, and codes that differ only where a value sits on a rounding
    boundary within the turn's fp32 rounding (the two order the matrix product's sums differently)."""
    from moefit.runtime.kv_codecs import Q4Rows
    torch.manual_seed(0)
    codec = Q4Rows(128)
    alloc = lambda shape, dtype: torch.zeros(shape, dtype=dtype)  # noqa: E731
    x = torch.randn(4, 40, 128) * torch.linspace(0.1, 8, 128)        # outlier channels, as keys have
    native_store = codec.empty(alloc, 4, 64)
    for t in range(40):                                               # a step's row at a time, as the writer takes them
        codec.put(native_store, slice(3 + t, 4 + t), x[:, t:t + 1])
    r = codec.rotation                                                # kv_codecs' torch coding, as on a card
    groups = (x.float() @ r).unflatten(-1, (-1, 32))
    scale = (groups.abs().amax(dim=-1, keepdim=True) / 7.0).clamp(min=1e-8)
    codes = (torch.round(groups / scale).clamp(-8, 7) + 8).to(torch.uint8).flatten(-2)
    want_x = codes[..., 0::2] | (codes[..., 1::2] << 4)
    assert torch.equal(native_store["s"][:, 3:43], scale.squeeze(-1).to(torch.float16))
    got = native_store["x"][:, 3:43]
    nibbles = lambda t: torch.stack((t & 15, t >> 4), -1).int()  # noqa: E731
    differ = (nibbles(got) != nibbles(want_x))
    assert (nibbles(got) - nibbles(want_x)).abs().max() <= 1 and differ.float().mean() < 1e-3
    assert torch.equal(native_store["x"][:, :3], torch.zeros_like(native_store["x"][:, :3]))   # nothing else written


@pytest.mark.parametrize("config", [dict(dense_quant="off")])
def test_what_it_does_not_take_runs_op_by_op(config, tmp_path):
    """An unquantised qkv: no native step, the same greedy tokens."""
    hf = tiny.build_checkpoint("qwen3_moe", tmp_path / "hf", head_dim=32)
    convert(hf, tmp_path / "pack", "int8", progress=False)
    engine = Engine.open(tmp_path / "pack", ServeConfig(ctx=64, **config))
    decode(engine)
    assert not engine.model.steps


def test_a_sliding_window_keeps_its_mask(tmp_path):
    """Mixtral with a sliding window shorter than the context: every decode step is masked, so it
    never takes the one call (which attends to every position)."""
    hf = tiny.build_checkpoint("mixtral", tmp_path / "hf", head_dim=32, sliding_window=6)
    convert(hf, tmp_path / "pack", "int8", progress=False)
    engine = Engine.open(tmp_path / "pack", ServeConfig(ctx=64, dense_quant="int8"))
    decode(engine)
    assert not engine.model.steps


def test_a_step_is_made_for_the_weights_it_is_given_not_the_index(tmp_path):
    """An MTP layer is computed as "layer 0" over its own cache (models/mtp.py): a one-call step
    made for the model's layer 0 must not serve it."""
    hf = tiny.build_checkpoint("qwen3_moe", tmp_path / "hf", head_dim=32)
    convert(hf, tmp_path / "pack", "int8", progress=False)
    engine = Engine.open(tmp_path / "pack", ServeConfig(ctx=64, dense_quant="int8"))
    decode(engine)
    model, pos = engine.model, len(PROMPT) + len(FORCED)
    other = dict(model.layers[1])                                       # other weights, asked for as layer 0
    cos, sin = model.rope.rows(pos, 1)
    x = torch.randn(1, model.cfg.hidden_size)
    model.attention_step(0, other, x, pos, cos, sin, None, engine.loaded.kv, other["q_norm"], other["k_norm"])
    made = {id(layer): step.weights.w for layer, step in model.steps.values()}
    assert made[id(other)] == other["qkv"].parts["w"].data_ptr() != made[id(model.layers[0])]


def test_mtp_drafts_are_the_same_with_the_one_call(tmp_path, monkeypatch):
    """GLM-4.5 with an MTP layer drafting: the same greedy tokens either way (how many drafts are
    made follows measured speeds, so the counts are not compared)."""
    from moefit.runtime.sampler import SamplingParams
    hf = tiny.add_mtp(tiny.build_checkpoint("glm4_moe", tmp_path / "hf", head_dim=32), "glm4_moe")
    convert(hf, tmp_path / "pack", "int8", progress=False)
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)

    def run():
        engine = Engine.open(tmp_path / "pack", ServeConfig(ctx=96, dense_quant="int8", spec="mtp", spec_window=3))
        tokens = engine.generate(PROMPT, greedy)[1].generated
        return engine, tokens
    engine, tokens = run()
    assert engine.spec_mode == "mtp" and engine.model.steps and engine.spec_stats.drafted > 0
    monkeypatch.setattr(DecoderModel, "attention_step", lambda *a, **k: None)
    assert run()[1] == tokens


@pytest.mark.parametrize("chunk,kv", [(4, "auto"), (512, "auto"), (4, "int8")])
def test_gpt_oss_sinks_and_sliding_rings_take_it(chunk, kv, tmp_path, monkeypatch):
    """gpt-oss (biases, attention sinks, a sliding window of 8 every other layer): every layer takes
    the one call, the sliding ones over their window's slots, in a ring of window + chunk slots
    past its wrap (chunk 4: 12 slots, 22 positions) or a whole-context store (chunk 512), fp32 rows
    or int8, and the logits equal the op-by-op path's to fp32 rounding (the sinks' sigmoid is C's
    expf there)."""
    forced = FORCED + [12, 1, 14, 3, 8, 25, 19]
    hf = tiny.build_checkpoint("gpt_oss", tmp_path / "hf", head_dim=32)
    convert(hf, tmp_path / "pack", "int8", progress=False)
    engine = Engine.open(tmp_path / "pack", ServeConfig(ctx=64, dense_quant="int8", prefill_chunk=chunk, kv_dtype=kv))
    assert any(layer.slot_pos is not None for layer in engine.loaded.kv.layers) == (chunk == 4)

    def run():
        engine.kv_tokens = []
        engine.prefill(PROMPT)
        return torch.stack([engine.decode_step(t, len(PROMPT) + i) for i, t in enumerate(forced)])
    calls = computed(monkeypatch)
    one_call = run()
    assert len(calls) == len(forced) * engine.model.cfg.num_layers and all(c is not None for c in calls)
    assert {tuple(c.shape) for c in calls} == {(1, engine.model.cfg.hidden_size)}        # o and its bias in the call
    monkeypatch.setattr(DecoderModel, "attention_step", lambda *a, **k: None)
    ops = run()
    assert float((one_call - ops).abs().max() / ops.abs().max()) < 1e-5


@pytest.mark.parametrize("d", [64, 128, 96])
def test_the_native_turn_is_the_rotation(d):
    """kv.h's turn (a Walsh-Hadamard transform where d is a power of two, the matrix otherwise)
    is kv_codecs' rotation and its transpose, to fp32 rounding."""
    from moefit.runtime.kv_codecs import rotation_matrix
    r = rotation_matrix(d).contiguous()
    x = torch.randn(8, 1, d)
    for back in (False, True):
        want = x @ (r.T if back else r)
        assert float((native.turn_rows(x, r, back) - want).abs().max()) < 1e-5 * float(want.abs().max()) + 1e-6


def test_a_projection_the_call_does_not_take_is_applied_after_it(tmp_path, monkeypatch):
    """Three heads of 16: the output projection's 48 inputs are not whole blocks of 32, which
    moe_linear refuses. The one call, refused before writing anything, is made again without the
    projection (from then on) and the layer projects its output op by op: the same logits."""
    hf = tiny.build_checkpoint("mixtral", tmp_path / "hf", head_dim=16, num_attention_heads=3, num_key_value_heads=1)
    convert(hf, tmp_path / "pack", "int8", progress=False)
    engine = Engine.open(tmp_path / "pack", ServeConfig(ctx=64, dense_quant="int8"))
    calls = computed(monkeypatch)
    one_call = decode(engine)
    assert len(calls) == len(FORCED) * engine.model.cfg.num_layers and all(c is not None for c in calls)
    assert {tuple(c.shape) for c in calls} == {(1, 48)}
    assert not any(step.projects for _, step in engine.model.steps.values())
    monkeypatch.setattr(DecoderModel, "attention_step", lambda *a, **k: None)
    assert torch.equal(one_call, decode(engine))


def test_no_step_is_a_block_while_host_calls_are_off(tmp_path, monkeypatch):
    """With host calls off on the thread (a recorded piece's forward: runtime/recorders.py), the
    steps made before are not called as blocks: torch's path runs (its dense products in fp32, not
    the kernel's int8 activations: other numbers, so only the path is checked)."""
    hf = tiny.build_checkpoint("qwen3_moe", tmp_path / "hf", head_dim=32)
    convert(hf, tmp_path / "pack", "int8", progress=False)
    engine = Engine.open(tmp_path / "pack", ServeConfig(ctx=64, dense_quant="int8"))
    blocks = []
    computed(monkeypatch, blocks)
    decode(engine)
    assert any(blocks) and engine.model.steps
    blocks.clear()
    engine.kv_tokens = []
    engine.prefill(PROMPT)
    with kernels.host_calls_off():
        off = torch.stack([engine.decode_step(t, len(PROMPT) + i) for i, t in enumerate(FORCED)])
    assert not any(blocks) and off.shape == (len(FORCED), engine.model.cfg.vocab_size) and off.isfinite().all()

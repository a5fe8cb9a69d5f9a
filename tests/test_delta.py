"""Gated DeltaNet's decode step in one native call (kernels/delta.h, Qwen3_5Moe.delta_steps)
against the same step op by op (Qwen3_5Moe.delta_ops: torch's conv, l2norm, recurrence and gated
norm): the output, the conv window and the state, over head shapes; the thread count and the
narrower instruction sets; a hybrid model's decode, which takes it for every DeltaNet layer; and
a verify window, a token at a time with the state kept after each position."""

import types

import pytest
import torch

from moefit import kernels
from moefit.kernels import rows
from moefit.models.qwen3_5_moe import Qwen3_5Moe
from narrow_isa import NARROWER, check_under

pytestmark = pytest.mark.skipif(kernels.library() is None, reason="the native kernel is not built")


def layer_of(hk: int, hv: int, dk: int, dv: int, kernel: int, seed: int):
    """A DeltaNet layer's weights and a model stand-in that delta_ops reads (dims, eps)."""
    g = torch.Generator().manual_seed(seed)
    channels = 2 * hk * dk + hv * dv
    layer = {"conv": torch.randn(channels, 1, kernel, generator=g) * 0.5, "a_log": torch.randn(hv, generator=g),
             "dt_bias": torch.randn(hv, generator=g), "gated_norm": torch.rand(dv, generator=g) + 0.5}
    model = types.SimpleNamespace(dims=(hk, hv, dk, dv, kernel), cfg=types.SimpleNamespace(rms_norm_eps=1e-6))
    return layer, model, channels


def state_of(channels: int, hv: int, dk: int, dv: int, kernel: int):
    g = torch.Generator().manual_seed(1)
    return types.SimpleNamespace(conv=torch.randn(channels, kernel - 1, generator=g),
                                 s=torch.randn(hv, dk, dv, generator=g) * 0.1, saved=None)


def native_step(layer: dict, model) -> rows.DeltaStep:
    return rows.DeltaStep(model.dims, layer["conv"], layer["a_log"], layer["dt_bias"], layer["gated_norm"],
                          model.cfg.rms_norm_eps)


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


# (Hk, Hv, Dk, Dv, taps): the tiny test shape; one key head for two value heads; Qwen3.6's head dims;
# more value columns than a register block and a remainder (80 = 64 + 16); a 3-tap conv
SHAPES = [(2, 4, 16, 16, 4), (1, 2, 32, 48, 4), (2, 2, 128, 128, 4), (4, 8, 64, 80, 3), (2, 4, 16, 144, 4)]


@pytest.mark.parametrize("shape", SHAPES)
def test_one_call_equals_the_step_op_by_op(shape):
    hk, hv, dk, dv, kernel = shape
    layer, model, channels = layer_of(*shape, seed=sum(shape))
    ops, one = state_of(channels, hv, dk, dv, kernel), state_of(channels, hv, dk, dv, kernel)
    step = native_step(layer, model)
    g = torch.Generator().manual_seed(2)
    for _ in range(4):                                               # the state carries from step to step
        proj = torch.randn(1, channels + hv * dv + 2 * hv, generator=g) * 2
        want = Qwen3_5Moe.delta_ops(model, layer, proj, ops)
        got = step(proj, one.conv, one.s)
        assert got is not None and relative(got, want) < 1e-5
        assert torch.equal(one.conv, ops.conv)
        assert relative(one.s, ops.s) < 1e-5


def test_it_refuses_what_it_does_not_take():
    """Head dims not multiples of 16, or tensors not fp32 on the host: None, and nothing changed."""
    layer, model, channels = layer_of(2, 4, 24, 16, 4, seed=3)
    state = state_of(channels, 4, 24, 16, 4)
    before = state.s.clone(), state.conv.clone()
    proj = torch.randn(1, channels + 4 * 16 + 8)
    assert native_step(layer, model)(proj, state.conv, state.s) is None
    assert torch.equal(state.s, before[0]) and torch.equal(state.conv, before[1])
    layer, model, channels = layer_of(2, 4, 16, 16, 4, seed=3)
    state = state_of(channels, 4, 16, 16, 4)
    before = state.s.clone(), state.conv.clone()
    proj = torch.randn(1, channels + 4 * 16 + 8, dtype=torch.float64)
    assert native_step(layer, model)(proj, state.conv, state.s) is None
    assert torch.equal(state.s, before[0]) and torch.equal(state.conv, before[1])


def test_the_thread_count_does_not_change_a_bit():
    layer, model, channels = layer_of(2, 8, 64, 64, 4, seed=4)
    proj = torch.randn(1, channels + 8 * 64 + 16, generator=torch.Generator().manual_seed(5))
    outs = []
    for n in (1, 2):
        kernels.set_threads(n)
        state = state_of(channels, 8, 64, 64, 4)
        outs.append((native_step(layer, model)(proj, state.conv, state.s), state.s))
    kernels.set_threads(kernels.default_threads())
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def check_every_shape() -> str:
    """The first test over every shape in one process (the narrower instruction sets run it)."""
    for shape in SHAPES:
        test_one_call_equals_the_step_op_by_op(shape)
    return kernels.isa()


@pytest.mark.parametrize("isa", NARROWER)
def test_the_narrower_instruction_sets_compute_the_same(isa):
    check_under(isa, "test_delta", "check_every_shape")


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
def test_a_hybrid_decode_takes_it_and_keeps_its_logits(family, tmp_path, monkeypatch):
    """Every DeltaNet layer of a decode step goes through the one call (a call that returned None
    counts for nothing), and the logits equal those op by op to fp32 rounding; the prompt (the
    chunked form) never takes it."""
    import tiny
    from moefit.config import ServeConfig
    from moefit.pack.convert import convert
    from moefit.runtime.engine import Engine
    convert(tiny.build_checkpoint(family, tmp_path / "hf"), tmp_path / "pack", "int8", progress=False)
    engine = Engine.open(tmp_path / "pack", ServeConfig(ctx=64))
    prompt, forced = list(range(3, 20)), [6, 17, 2, 9]
    taken = []
    real = Qwen3_5Moe.delta_steps

    def counted(self, layer, proj, state):
        out = real(self, layer, proj, state)
        taken.append((proj.shape[0], out is not None))
        return out

    def decode() -> torch.Tensor:
        engine.kv_tokens = []
        engine.prefill(prompt)
        return torch.stack([engine.decode_step(t, len(prompt) + i) for i, t in enumerate(forced)])

    monkeypatch.setattr(Qwen3_5Moe, "delta_steps", counted)
    native = decode()
    linear = sum("linear" in layer for layer in engine.model.layers)
    assert taken == [(1, True)] * linear * len(forced)
    monkeypatch.setattr(Qwen3_5Moe, "delta_steps", lambda *a: None)
    assert relative(native, decode()) < 1e-5


def test_a_verify_window_goes_a_token_at_a_time_and_keeps_its_checkpoints(tmp_path, monkeypatch):
    """A checkpointed window of 4 tokens through the native steps: the window's logits, and after
    keep(2) (a rejection after the second) every DeltaNet layer's state and conv window, equal the
    op-by-op recurrence's; a state not kept would be the window's end, 2 tokens off."""
    import tiny
    from moefit.config import ServeConfig
    from moefit.pack.convert import convert
    from moefit.runtime.engine import Engine
    from moefit.runtime.recurrent_state import RecurrentLayerState
    convert(tiny.build_checkpoint("qwen3_5_moe", tmp_path / "hf"), tmp_path / "pack", "int8", progress=False)
    engine = Engine.open(tmp_path / "pack", ServeConfig(ctx=64))
    prompt, window = list(range(3, 20)), [6, 17, 2, 9]
    kv = engine.loaded.kv

    def verify():
        engine.kv_tokens = []
        engine.prefill(prompt)
        kv.checkpoint(True)
        try:
            logits = engine.forward(window, len(prompt))
        finally:
            kv.checkpoint(False)
        kv.keep(2)
        kept = [(layer.s.clone(), layer.conv.clone()) for layer in kv.layers if isinstance(layer, RecurrentLayerState)]
        return logits, kept

    real, calls = Qwen3_5Moe.delta_steps, []
    monkeypatch.setattr(Qwen3_5Moe, "delta_steps", lambda *a: calls.append(a[2].shape[0]) or real(*a))
    native, native_kept = verify()
    assert len(window) in calls
    monkeypatch.setattr(Qwen3_5Moe, "delta_steps", lambda *a: None)
    ops, ops_kept = verify()
    assert relative(native, ops) < 1e-5
    for (s, conv), (s_ops, conv_ops) in zip(native_kept, ops_kept):     # (later layers' inputs differ by rounding)
        assert relative(s, s_ops) < 1e-5 and relative(conv, conv_ops) < 1e-5

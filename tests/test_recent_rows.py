"""gpt-oss's decode step reads the rows it attends in place (runtime/state.recent_rows,
models/attention._recent_attention): the whole context of a full-attention layer, a sliding
layer's window from its ring in one run of slots or two; against the masked torch route
(attend_parts), the same logits to fp32 rounding, on every KV dtype, across the ring's wrap."""

from types import SimpleNamespace

import pytest
import torch

from moefit import kernels
from moefit.config import ServeConfig
from moefit.families.state import AttentionKV
from moefit.memory.devices import open_device
from moefit.models import attention
from moefit.pack.convert import convert
from moefit.runtime.engine import Engine
from moefit.runtime.placement import DeviceMemory
from moefit.runtime.state import SequenceState

import tiny

pytestmark = pytest.mark.skipif(kernels.library() is None, reason="the native kernel is not built")
PROMPT = [5, 9, 13, 2, 7, 11, 3, 8, 21, 4]
FORCED = [6, 17, 2, 9, 30, 12, 1, 14, 3, 8, 25, 19]        # 22 positions: past the 12-slot rings


def decode(engine: Engine) -> torch.Tensor:
    engine.kv_tokens = []
    engine.prefill(PROMPT)
    return torch.stack([engine.decode_step(t, len(PROMPT) + i) for i, t in enumerate(FORCED)])


@pytest.mark.parametrize("kv_dtype", ["fp32", "int8", "q4"])
def test_gpt_oss_decodes_in_place_with_the_masked_routes_logits(kv_dtype, tmp_path, monkeypatch):
    hf = tiny.build_checkpoint("gpt_oss", tmp_path / "hf", head_dim=32)
    convert(hf, tmp_path / "pack", "int8", progress=False)
    engine = Engine.open(tmp_path / "pack", ServeConfig(ctx=64, kv_dtype=kv_dtype, prefill_chunk=4))
    assert any(layer.slot_pos is not None for layer in engine.loaded.kv.layers)           # a ring to wrap
    read, real = [], attention._recent_attention
    monkeypatch.setattr(attention, "_recent_attention", lambda *a: read.append(real(*a)) or read[-1])
    native = decode(engine)
    assert len(read) == len(FORCED) * engine.model.cfg.num_layers and all(r is not None for r in read)
    monkeypatch.setattr(attention, "_recent_attention", lambda *a: None)
    masked = decode(engine)
    assert float((native - masked).abs().max() / masked.abs().max()) < 1e-5


def test_a_rings_window_is_read_in_one_run_or_two():
    """Window 6 in a ring of 9 slots: the window's positions, in order, wherever they wrap; a
    position the ring lost (a rejected speculative token's slot) leaves it to the masked route."""
    state = SequenceState(SimpleNamespace(sliding_window=None), 40, "fp32", torch.float32,
                          DeviceMemory(open_device("cpu")), 3, decls=[AttentionKV(1, 16, 16, window=6)])
    layer = state.layers[0]
    assert layer.capacity == 9
    for end in range(1, 30):
        pos = torch.full((1, 1, 16), float(end - 1))
        state.write(0, end - 1, pos, pos)
        runs = state.recent_rows(0, end)
        got = torch.cat([k.decode(torch.float32)[0, :, 0] for k, _ in runs])
        assert got.tolist() == list(range(max(0, end - 6), end)) and len(runs) <= 2
    layer.slot_pos[(end - 3) % layer.capacity] = 1 << 62                     # that slot taken by another
    assert state.recent_rows(0, end) is None


def test_a_steps_kv_description_follows_the_pair_it_is_handed():
    """A decode step keeps kv.h's description of the (k, v) pair it was last handed (a state's
    whole-store pair, the same every token) and describes again when handed another session's."""
    from moefit.kernels.rows import KvPair
    states = [SequenceState(SimpleNamespace(sliding_window=None), 40, "int8", torch.float32,
                            DeviceMemory(open_device("cpu")), 3, decls=[AttentionKV(2, 16, 16)]) for _ in range(2)]
    pair = KvPair()
    for layer in (states[0].layers[0], states[1].layers[0], states[0].layers[0]):
        kr, vr = pair(*layer.whole)
        assert (kr.x, kr.s, vr.x) == (layer.k["x"].data_ptr(), layer.k["s"].data_ptr(), layer.v["x"].data_ptr())
        assert pair(*layer.whole)[0] is kr

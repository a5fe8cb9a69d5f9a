"""KV streaming (the card holds the most recent --kv-resident tokens, the host the rest) and
4-bit KV: attention over both parts is exact, so greedy output does not move."""

import pytest
import torch
import torch.nn.functional as F

from moefit.config import ServeConfig
from moefit.families.state import AttentionKV
from moefit.memory.devices import open_device
from moefit.models.attention import attend_state, causal_mask
from moefit.runtime.engine import Engine
from moefit.runtime.kv_codecs import Q4Rows, rotation_matrix
from moefit.runtime.placement import DeviceMemory
from moefit.runtime.sampler import SamplingParams
from moefit.runtime.state import AttentionState, SequenceState

from conftest import FAMILIES

GEN = torch.Generator().manual_seed(11)
PROMPT = torch.randint(3, 300, (100,), generator=GEN).tolist()
LOOPY = ([5, 9, 17, 33, 65, 129] * 20)[:90]                    # lookup drafts find matches in it
GREEDY = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)


def greedy(pack, prompt=PROMPT, **cfg):
    engine = Engine.open(pack, ServeConfig(ctx=256, prefill_chunk=16, **cfg))
    _, stats, _ = engine.generate(prompt, GREEDY)
    return stats.generated, engine


@pytest.mark.parametrize("family", FAMILIES)
def test_streaming_gives_the_same_logits_and_greedy_tokens(family, packs):
    whole, _ = greedy(packs(family))
    streamed, engine = greedy(packs(family), kv_resident="32")    # 148 tokens through a 32-token window
    assert streamed == whole
    rings = [layer.capacity for layer in engine.loaded.kv.layers if isinstance(layer, AttentionState) and layer.host]
    assert engine.loaded.kv.host_bytes() > 0 and set(rings) == {32}              # sliding layers keep their own ring
    a = Engine.open(packs(family), ServeConfig(ctx=256, prefill_chunk=16))
    b = Engine.open(packs(family), ServeConfig(ctx=256, prefill_chunk=16, kv_resident="32"))
    la, _ = a.prefill(PROMPT)
    lb, _ = b.prefill(PROMPT)
    assert torch.allclose(la, lb, atol=1e-5, rtol=0)
    for i, tok in enumerate(PROMPT[:20]):
        x, y = a.decode_step(tok, len(PROMPT) + i), b.decode_step(tok, len(PROMPT) + i)
        assert (x - y).abs().max() <= 1e-5 * x.abs().max()     # the parts sum in another order: fp32's rounding


def test_streaming_survives_rejected_drafts(packs):
    whole, _ = greedy(packs("qwen3_moe"), LOOPY)
    streamed, engine = greedy(packs("qwen3_moe"), LOOPY, kv_resident="16", spec="lookup", spec_window=6)
    assert engine.spec_stats.drafted > engine.spec_stats.accepted > 0    # some drafts were rejected
    assert streamed == whole


def test_prefix_reuse_across_turns_works_with_streamed_kv(packs):
    """The second turn shares 120 tokens with the first (which went on 48 tokens further):
    streamed and whole-context engines give the second turn the same tokens, and both reuse."""
    first = PROMPT + [7, 8, 9]
    engine = Engine.open(packs("qwen3_moe"), ServeConfig(ctx=256, prefill_chunk=16, kv_resident="32"))
    _, stats, _ = engine.generate(first, GREEDY)
    second = first + stats.generated[:17] + [11, 12, 13, 14]
    _, reused = engine.prefill(second)
    assert reused == len(first) + 17
    got = engine.generate(second, GREEDY)[1].generated
    assert got == greedy(packs("qwen3_moe"), second)[0]


def _state(decl, ctx, kv_dtype="fp32", resident=None, window=None, chunk=4):
    class M:
        sliding_window = window
        layer_states = lambda self: [decl]  # noqa: E731
    return SequenceState(M(), ctx, kv_dtype, torch.float32, DeviceMemory(open_device("cpu")), chunk, resident)


def _reference(q, k, v, start, window):
    mask = causal_mask(start, q.shape[1], window, "cpu")
    out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, enable_gqa=True)[0]
    return out.transpose(0, 1).reshape(q.shape[1], -1)


@pytest.mark.parametrize("window,resident", [(None, 8), (6, None), (6, 8)])
def test_a_ring_and_its_host_part_attend_exactly_like_the_whole_context(window, resident):
    """Chunks of 4 and single tokens into a ring (a sliding window of 6, or 8 resident tokens of
    a streaming layer), with 5 drafted positions written and then rejected: they took the ring
    slots of older positions, which the host part must then serve."""
    decl = AttentionKV(2, 16, 16, window if resident is None else None)
    state = _state(decl, 64, resident=resident, window=window)
    k_all, v_all = torch.randn(2, 64, 16, generator=GEN), torch.randn(2, 64, 16, generator=GEN)
    pos = 0
    for step in range(14):
        t = 4 if step % 3 else 1
        if step == 9:                                             # drafts at pos..pos+5, then rejected
            assert t == 1
            state.write(0, pos, torch.randn(2, 5, 16, generator=GEN), torch.randn(2, 5, 16, generator=GEN))
        state.write(0, pos, k_all[:, pos:pos + t], v_all[:, pos:pos + t])
        q = torch.randn(4, t, 16, generator=GEN)
        mask = causal_mask(pos, t, window, "cpu")
        got = attend_state(state, 0, q, pos, mask)
        want = _reference(q, k_all[:, :pos + t], v_all[:, :pos + t], pos, window)
        assert torch.allclose(got, want, atol=1e-5), f"step {step}"
        pos += t


def test_the_rotation_is_orthonormal_and_q4_rows_round_trip_within_4_bits():
    for d in (64, 96, 128):
        r = rotation_matrix(d)
        assert torch.allclose(r @ r.T, torch.eye(d), atol=1e-5)
    codec, x = Q4Rows(64), torch.randn(2, 5, 64, generator=GEN)
    x[..., 3] *= 20                                                # an outlier channel, as real keys have
    store = codec.empty(lambda shape, dtype: torch.empty(shape, dtype=dtype), 2, 5)
    codec.put(store, slice(0, 5), x)
    back = codec.get(store, slice(0, 5), torch.float32) @ codec.rotation.T
    assert ((back - x).norm() / x.norm()) < 0.12


@pytest.mark.parametrize("kv_dtype,bound", [("q4", 0.15), ("k8v4", 0.15), ("int8", 0.02)])
def test_quantised_kv_on_the_demo_stays_close_to_fp32(kv_dtype, bound):
    """The demo (head dim 64, trained weights): teacher-forced logits of 4-bit KV against fp32."""
    from moefit.demo import demo_pack
    text = list(range(40, 200))
    ref = Engine.open(demo_pack(), ServeConfig(ctx=256, prefill_chunk=64))
    got = Engine.open(demo_pack(), ServeConfig(ctx=256, prefill_chunk=64, kv_dtype=kv_dtype))
    a, _ = ref.prefill(text)
    b, _ = got.prefill(text)
    assert ((a - b).norm() / a.norm()) < bound


def test_the_demo_serves_a_64k_context_on_its_simulated_card(tmp_path):
    """`make run`'s configuration: 65,536 tokens of context, 2,048 of them on the card. A prompt
    of 65,000 tokens is prefilled in 128-token chunks and decoded; the card's bytes do not move."""
    import argparse
    import shutil
    from moefit.cli import add_serve_flags, add_state_flags, serve_config
    from moefit.demo import CARD, SIM_FLAGS, demo_pack
    card = tmp_path / "card.json"
    shutil.copy(CARD, card)
    parser = argparse.ArgumentParser()
    add_serve_flags(parser)
    add_state_flags(parser)
    cfg = serve_config(parser.parse_args(SIM_FLAGS + ["--device", f"sim:{card}"]))
    engine = Engine.open(demo_pack(), cfg)
    p = engine.loaded.plan
    assert cfg.ctx == 65536 and p.kv_resident == 2048 and p.serve_status == "OK" and p.slots >= 16
    card_bytes = engine.loaded.mem.total_charged()
    ids = (engine.codec.encode("Define: lantern. A lamp with a case of glass, carried by hand.\n") * 5000)[:65000]
    logits, _ = engine.prefill(ids)
    tokens = [int(logits.argmax())]
    for i in range(8):
        tokens.append(int(engine.decode_step(tokens[-1], len(ids) + i).argmax()))
    assert torch.isfinite(logits).all() and engine.loaded.mem.total_charged() == card_bytes
    assert engine.loaded.kv.host_bytes() == 4 * 2 * 2 * 65536 * 64 * 4          # layers x k,v x heads x ctx x D x fp32

"""MTP layers as a draft source (issue 13): packed from the checkpoint, computed as transformers'
own decoder layer computes them, lossless as drafts, their KV kept in step with the tokens, and
paid for from the reserve."""

import json
from pathlib import Path

import pytest
import torch

from moefit.config import ModelConfig, ServeConfig
from moefit.memory.footprint import from_config, from_pack_header
from moefit.models.mtp import mtp_forward, mtp_logits
from moefit.pack.convert import convert
from moefit.runtime.engine import Engine
from moefit.runtime.mtp import MtpDrafter
from moefit.runtime.sampler import SamplingParams
from moefit.runtime.state import SequenceState

import tiny

MTP_FAMILIES = ("qwen3_next", "qwen3_5_moe", "deepseek_v3", "glm4_moe", "glm4_moe_lite")
GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
PROMPT = [5, 17, 42, 99, 7, 3, 150, 220, 31, 64] * 3 + [5, 17]


@pytest.fixture(scope="module")
def mtp_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    return {f: tiny.add_mtp(tiny.build_checkpoint(f, root / f, seed=i), f) for i, f in enumerate(MTP_FAMILIES)}


@pytest.fixture(scope="module")
def mtp_packs(mtp_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp-packs")
    made = {}

    def get(family, quant="fp32"):
        if (family, quant) not in made:
            made[(family, quant)] = root / f"{family}-{quant}"
            convert(mtp_checkpoints[family], made[(family, quant)], recipe=quant, progress=False)
        return made[(family, quant)]
    return get


def reference_mtp_logits(ckpt, family, tokens: list[int]) -> torch.Tensor:
    """The MTP layer's logits at positions 0..T-2 computed with transformers' own modules: the
    model's final hidden states, the family's decoder layer and RMSNorm, the model's lm_head."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    weights = load_file(str(ckpt / "mtp.safetensors"))
    layer, mod = tiny.mtp_decoder_layer(model.config, family)
    qwen = tiny.MTP_NAMES[family] == "qwen"
    prefix = "mtp.layers.0." if qwen else f"model.layers.{model.config.num_hidden_layers}."
    own = {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}
    layer.load_state_dict(_fused_experts(own, layer.state_dict()), strict=True)
    norm_cls = type(model.model.norm)
    e, eps = model.config.hidden_size, model.config.rms_norm_eps

    def norm(name):
        n = norm_cls(e, eps=eps)
        n.weight.data.copy_(weights[name])
        return n
    names = (["mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.fc.weight", "mtp.norm.weight"]
             if qwen else [prefix + n for n in ("enorm.weight", "hnorm.weight", "eh_proj.weight",
                                                "shared_head.norm.weight")])
    ids = torch.tensor([tokens])
    with torch.no_grad():
        h = model.model(input_ids=ids).last_hidden_state[0, :-1]                       # h_0 .. h_{T-2}
        emb = model.model.embed_tokens(ids[0, 1:])                                      # t_1 .. t_{T-1}
        if not qwen:
            emb[0] = 0                                                                   # position 0
        x = torch.nn.functional.linear(torch.cat((norm(names[0])(emb), norm(names[1])(h)), -1), weights[names[2]])
        pos = torch.arange(x.shape[0])[None]
        cos_sin = model.model.rotary_emb(x[None], pos)
        mask = torch.full((x.shape[0], x.shape[0]), float("-inf")).triu(1)[None, None]
        y = layer(x[None], attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
        y = y[0] if isinstance(y, tuple) else y
        return model.lm_head(norm(names[3])(y[0]))


def _fused_experts(own: dict, want: dict) -> dict:
    """Per-expert checkpoint keys back into transformers' fused expert tensors."""
    out = {k: v for k, v in own.items() if ".experts." not in k and k in want}
    for key in want:
        if key.endswith("experts.gate_up_proj"):
            n = want[key].shape[0]
            out[key] = torch.stack([torch.cat((own[f"mlp.experts.{x}.gate_proj.weight"],
                                               own[f"mlp.experts.{x}.up_proj.weight"])) for x in range(n)])
        elif key.endswith("experts.down_proj"):
            out[key] = torch.stack([own[f"mlp.experts.{x}.down_proj.weight"] for x in range(want[key].shape[0])])
    return out


@pytest.mark.parametrize("family", MTP_FAMILIES)
def test_the_mtp_layer_matches_transformers_own_decoder_layer(family, mtp_checkpoints, mtp_packs):
    pack = mtp_packs(family)
    header = json.loads((pack / "moefit-pack.json").read_text())
    assert header["mtp"] == {"layers": 1, "style": tiny.MTP_NAMES[family]}
    assert not any(k.endswith(("shared_head.head.weight", f"{header['model_config'].get('num_hidden_layers')}"
                               ".embed_tokens.weight")) for k in header["dense"]["tensors"])
    engine = Engine.open(pack, ServeConfig(ctx=128, spec="mtp"))
    tokens = PROMPT[:20]
    engine.forward(tokens, 0)
    h = engine.hidden                                                                 # the model's [T, E]
    state = SequenceState(engine.pack.model, 128, "fp32", torch.float32, engine.loaded.mem, 64,
                          decls=[engine.pack.model.spec.mtp_state(engine.pack.model)])
    mtp = engine.mtp
    hidden = mtp_forward(engine.model, mtp.mtp, h[:-1], torch.tensor(tokens[1:]), 0, state, mtp.experts)
    got = mtp_logits(engine.model, mtp.mtp, hidden)
    want = reference_mtp_logits(mtp_checkpoints[family], family, tokens)
    assert (got - want).abs().max() < 1e-4


@pytest.mark.parametrize("family", MTP_FAMILIES)
def test_mtp_drafts_keep_greedy_output(family, mtp_packs):
    pack = mtp_packs(family, "int8")
    want = Engine.open(pack, ServeConfig(ctx=128)).generate(PROMPT, GREEDY)[1].generated
    engine = Engine.open(pack, ServeConfig(ctx=128, spec="mtp", spec_window=3))
    got = engine.generate(PROMPT, GREEDY)[1].generated
    assert engine.spec_mode == "mtp" and engine.spec_stats.drafted > 0
    assert got == want


@pytest.mark.parametrize("family", ("qwen3_next", "deepseek_v3"))
def test_the_mtp_kv_is_what_one_pass_over_the_kept_tokens_writes(family, mtp_packs, monkeypatch):
    """Drafts made to be half right (the greedy continuation, its last one spoiled) so windows
    keep some and reject others, across a prompt reuse: the MTP layer's KV rows for every
    written position equal those one MTP forward over the final sequence writes."""
    pack = mtp_packs(family)
    want = Engine.open(pack, ServeConfig(ctx=128)).generate(PROMPT, GREEDY)[1].generated
    real = MtpDrafter.propose

    def half_right(self, tokens, k):
        real(self, tokens, k)                                          # the real bookkeeping and chain
        done = len(tokens) - len(PROMPT)
        drafts = want[done:done + k]
        return drafts[:-1] + [(drafts[-1] + 1) % 300] if len(drafts) > 1 else drafts
    monkeypatch.setattr(MtpDrafter, "propose", half_right)
    engine = Engine.open(pack, ServeConfig(ctx=128, spec="mtp", spec_window=4))
    engine.generate(PROMPT[:12], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    got = engine.generate(PROMPT, GREEDY)[1]
    assert got.generated == want
    assert got.cached_tokens == 12        # the first prompt's end: DeltaNet's state and the MTP's input kept there
    assert engine.spec_stats.drafted > engine.spec_stats.accepted > 0
    seq = engine.kv_tokens
    engine.mtp.catch_up(seq)                                  # the rows held since the last draft, written
    done = engine.mtp.done
    assert done == len(seq) - 1
    fresh = SequenceState(engine.pack.model, 128, "fp32", torch.float32, engine.loaded.mem, 64,
                          decls=[engine.pack.model.spec.mtp_state(engine.pack.model)])
    engine.forward(seq, 0)
    mtp_forward(engine.model, engine.mtp.mtp, engine.hidden[:done], torch.tensor(seq[1:done + 1]), 0, fresh,
                engine.mtp.experts)
    ours, ref = engine.mtp.state.layers[0], fresh.layers[0]
    for a, b in ((ours.k, ref.k), (ours.v, ref.v)):
        diff = (a["x"][:, :done] - b["x"][:, :done]).abs().amax(dim=(0, 2))
        assert diff.max() < 1e-4, f"rows that differ: {(diff >= 1e-4).nonzero().flatten().tolist()} of {done}"


def test_the_mtp_layer_is_paid_for_from_the_reserve(mtp_packs, card):
    pack = mtp_packs("deepseek_v3", "int8")
    header = json.loads((pack / "moefit-pack.json").read_text())
    fp = from_pack_header(header, "fp32")
    assert fp.mtp_layers == 1 and fp.mtp_dense_bytes > 0
    assert all(k[0] < fp.model.num_layers for k in fp.blob_sizes)             # its experts are not the cache's
    cfg = ServeConfig(device=f"sim:{card(64)}", ctx=128, spec="mtp", spec_window=3, vram_reserve_mib=24)
    engine = Engine.open(pack, cfg)
    assert engine.spec_mode == "mtp" and engine.plan.spec_enabled
    want = fp.mtp_bytes(128, engine.plan.kv_dtype, cfg.prefill_chunk)
    assert engine.plan.reserve.draft == want
    assert engine.loaded.mem.charged["reserve"] == want                     # weights and KV, exactly
    auto = Engine.open(pack, cfg.with_(spec="auto"))
    assert auto.spec_mode == "mtp"


@pytest.mark.parametrize("family", ["glm4_moe", "qwen3_5_moe", "glm4_moe_lite"])
def test_dense_quant_covers_the_mtp_layer_and_its_reserve(family, mtp_packs, card):
    """--dense-quant quantises the MTP layer's matrices as the model's (its drafts ran fp32 matrices,
    ~7x the bytes at 4 bits), the reserve holds what they take, exactly, and greedy output holds."""
    from moefit.models.layers import QWeight
    pack = mtp_packs(family, "int8")
    fp = from_pack_header(json.loads((pack / "moefit-pack.json").read_text()), "fp32", "int8")
    cfg = ServeConfig(device=f"sim:{card(64)}", ctx=128, spec="mtp", spec_window=3, vram_reserve_mib=24,
                      dense_quant="int8")
    engine = Engine.open(pack, cfg)
    attention = engine.mtp.mtp["layer"].get("qkv", engine.mtp.mtp["layer"].get("q"))        # MLA: q
    assert isinstance(attention, QWeight) and isinstance(engine.mtp.mtp["project"], QWeight)
    assert engine.loaded.mem.charged["reserve"] == fp.mtp_bytes(128, engine.plan.kv_dtype, cfg.prefill_chunk)
    unquantised = from_pack_header(json.loads((pack / "moefit-pack.json").read_text()), "fp32")
    assert fp.mtp_dense_bytes < unquantised.mtp_dense_bytes / 2
    want = Engine.open(pack, cfg.with_(spec="off")).generate(PROMPT, GREEDY)[1].generated
    assert engine.generate(PROMPT, GREEDY)[1].generated == want


def test_under_kv_streaming_the_mtp_kv_streams_too_and_greedy_holds(mtp_packs, card):
    """The MTP layer keeps the model's resident window on the card and the rest on the host, as
    the model's layers do: the reserve holds the window's bytes, and the output is unchanged."""
    pack = mtp_packs("glm4_moe", "int8")
    cfg = ServeConfig(device=f"sim:{card(64)}", ctx=128, prefill_chunk=16, kv_resident="16", spec="mtp",
                      spec_window=3, vram_reserve_mib=24)
    want = Engine.open(pack, cfg.with_(spec="off")).generate(PROMPT, GREEDY)[1].generated
    engine = Engine.open(pack, cfg)
    fp = from_pack_header(json.loads((pack / "moefit-pack.json").read_text()), "fp32")
    assert engine.plan.kv_resident == 16
    assert engine.loaded.mem.charged["reserve"] == fp.mtp_bytes(128, engine.plan.kv_dtype, 16, 16) \
        < fp.mtp_bytes(128, engine.plan.kv_dtype, 16)
    assert engine.generate(PROMPT, GREEDY)[1].generated == want and engine.spec_stats.drafted > 0


def test_spec_mtp_without_mtp_layers_says_so(packs):
    engine = Engine.open(packs("qwen3_moe"), ServeConfig(ctx=64, spec="mtp"))
    assert engine.spec_mode == "off" and "no MTP layers" in engine.spec_reason


def test_plan_counts_the_published_mtp_layers():
    """DeepSeek-V3's layer 61 and GLM-4.5-Air's layer 46 are MTP layers; the plan prices the
    first as a draft source (weights + its KV) and keeps them out of the dense line."""
    for name, layers in (("deepseek-v3", 61), ("glm-4.5-air", 46), ("qwen3.6-35b-a3b", 40)):
        m = ModelConfig.from_hf_file(Path(__file__).parents[1] / "configs" / f"{name}.json")
        fp = from_config(m, "int4", "bf16")
        assert m.mtp_layers == 1 and m.num_layers == layers
        assert 0 < fp.mtp_dense_bytes < fp.dense_bytes
        assert fp.mtp_bytes(4096, "bf16", 512) > fp.mtp_dense_bytes


def test_each_session_has_its_own_mtp_kv_in_the_reserve(mtp_packs, card):
    """--sessions 2 with MTP drafts (a hybrid): each conversation's MTP rows are its own, so two
    interleaved conversations keep greedy output and resume where they were; the reserve holds
    the MTP weights once and its KV once a session, exactly."""
    pack = mtp_packs("qwen3_next", "int8")
    cfg = ServeConfig(device=f"sim:{card(64)}", ctx=128, spec="mtp", spec_window=3, vram_reserve_mib=24, sessions=2)
    engine = Engine.open(pack, cfg)
    fp = from_pack_header(json.loads((pack / "moefit-pack.json").read_text()), "fp32")
    assert engine.loaded.mem.charged["reserve"] == fp.mtp_bytes(128, engine.plan.kv_dtype, cfg.prefill_chunk,
                                                                sessions=2) == engine.plan.reserve.draft
    other = [201, 202, 203, 204] * 3
    plain = Engine.open(pack, cfg.with_(spec="off", sessions=1))
    for prompt in (PROMPT, other, PROMPT + [9], other + [9]):
        want = plain.generate(prompt, GREEDY)[1].generated
        got = engine.generate(prompt, GREEDY)[1]
        assert got.generated == want
    assert got.cached_tokens == len(other) and engine.spec_stats.drafted > 0
    again = engine.generate(other + [9], GREEDY)[1]                         # the same prompt: nothing runs
    assert again.cached_tokens == len(other) + 1 and again.generated == got.generated


def test_a_kept_session_keeps_its_mtp_rows(mtp_packs, tmp_path):
    """serve --keep-sessions (runtime/kept.py) with MTP drafts: the MTP layer's KV rows and the
    hidden states it has not written yet come back with the session."""
    from moefit.runtime import kept
    pack, cfg = mtp_packs("deepseek_v3"), ServeConfig(ctx=128, spec="mtp", spec_window=3)
    before = Engine.open(pack, cfg)
    reply = before.generate(PROMPT, GREEDY)[1].generated
    kept.save(before, tmp_path)
    after = Engine.open(pack, cfg)
    kept.restore(after, tmp_path)
    a, b = after.mtp, before.mtp
    assert a.done == b.done > 0 and torch.equal(a.pending, b.pending)
    for x, y in ((a.state.layers[0].k, b.state.layers[0].k), (a.state.layers[0].v, b.state.layers[0].v)):
        assert all(torch.equal(x[name][:, :a.done], y[name][:, :b.done]) for name in x)
    turn = PROMPT + reply + [11, 12]
    resumed, continued = after.generate(turn, GREEDY)[1], before.generate(turn, GREEDY)[1]
    assert resumed.generated == continued.generated and resumed.cached_tokens == continued.cached_tokens


@pytest.mark.parametrize("family", ["qwen3_5_moe", "glm4_moe"])
def test_mtp_drafts_with_recorded_decode_steps_keep_greedy_output(family, mtp_packs, card, monkeypatch):
    """--decode-graphs on (runtime/decode_graphs.py, the simulated card's tape): decode steps and
    verify windows replay their pieces, Qwen3.5's DeltaNet layers rolling back from checkpoints
    the pieces wrote; the tokens are those of plain greedy decoding."""
    from moefit.runtime import decode_graphs
    monkeypatch.setattr(decode_graphs, "MIN_BUCKET", 16)
    pack = mtp_packs(family, "int8")
    base = ServeConfig(device=f"sim:{card(64)}", ctx=128, vram_reserve_mib=24, low_headroom_mib=0)
    want = Engine.open(pack, base).generate(PROMPT, GREEDY)[1].generated
    engine = Engine.open(pack, base.with_(spec="mtp", spec_window=3, decode_graphs="on"))
    got = engine.generate(PROMPT, GREEDY)[1].generated
    assert engine.spec_stats.drafted > 0 and engine.graphs.replays > 0
    assert max(key[-1] for key in engine.graphs.pieces if key[0] == "tail") > 1     # windows recorded
    assert got == want

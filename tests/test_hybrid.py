"""The hybrid family (Qwen3.5 / 3.6-MoE): Gated DeltaNet's recurrent state under speculative
rejection and prefix reuse, and its two forms against transformers' reference."""

import torch

from moefit.config import ServeConfig
from moefit.models import deltanet
from moefit.runtime.engine import Engine
from moefit.runtime.sampler import SamplingParams

GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
LOOPY = ([5, 9, 17, 33, 65, 129] * 20)[:90]


def test_chunked_and_recurrent_delta_rule_match_transformers():
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import torch_chunk_gated_delta_rule
    gen = torch.Generator().manual_seed(3)
    h, t, d = 4, 150, 16
    q, k, v = (torch.randn(1, t, h, d, generator=gen) for _ in range(3))
    g, beta = -torch.rand(1, t, h, generator=gen), torch.rand(1, t, h, generator=gen)
    s0 = torch.randn(1, h, d, d, generator=gen)
    want, want_s = torch_chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0.clone(), output_final_state=True,
                                                use_qk_l2norm_in_kernel=True)
    heads = lambda x: x[0].transpose(0, 1)  # noqa: E731
    qq, kk = deltanet.l2norm(heads(q)) / d ** 0.5, deltanet.l2norm(heads(k))
    for rule in (deltanet.recurrent, deltanet.chunked):
        s = s0[0].clone()
        out = rule(qq, kk, heads(v), g[0].T.contiguous(), beta[0].T.contiguous(), s)
        assert torch.allclose(out.transpose(0, 1), want[0], atol=1e-5) and torch.allclose(s, want_s[0], atol=1e-5)


def test_strongly_decaying_heads_stay_out_of_subnormals_and_agree():
    """Heads that decay by up to e^-40 a token: the chunked form's decay factors hold no subnormal
    (each costs a microcode assist, 4x the prompt's time at Qwen3.6's shape) and it still equals
    the recurrent form."""
    gen = torch.Generator().manual_seed(4)
    h, t, d = 3, 130, 16
    q, k, v = (torch.randn(h, t, d, generator=gen) for _ in range(3))
    q, k = deltanet.l2norm(q) / d ** 0.5, deltanet.l2norm(k)
    g, beta = -torch.rand(h, t, generator=gen) * 40, torch.rand(h, t, generator=gen)
    factors = deltanet.decay_exp(g.view(h, -1, 10).cumsum(-1))
    assert not ((factors != 0) & (factors < torch.finfo(torch.float32).tiny)).any()
    s0 = torch.randn(h, d, d, generator=gen)
    s1, s2 = s0.clone(), s0.clone()
    assert torch.allclose(deltanet.chunked(q, k, v, g, beta, s1), deltanet.recurrent(q, k, v, g, beta, s2), atol=1e-5)
    assert torch.allclose(s1, s2, atol=1e-5)


def test_a_rejected_draft_across_deltanet_layers_keeps_greedy_output(packs, monkeypatch):
    """An oracle draft source that knows the greedy continuation and spoils each window's last
    draft: every window is cut short after its DeltaNet layers consumed the rejected token, so
    each one exercises the way back: each DeltaNet layer's checkpoint after the kept tokens
    (no extra forward of the model), taken in the verify arena and given back."""
    from moefit.runtime import decoding
    pack = packs("qwen3_5_moe")
    want = Engine.open(pack, ServeConfig(ctx=256)).generate(LOOPY, GREEDY)[1].generated

    def oracle(engine, lookup, token, k):
        done = len(engine.kv_tokens) + 1 - len(LOOPY)               # tokens generated so far
        drafts = want[done:done + k]
        return drafts[:-1] + [(drafts[-1] + 1) % 300] if len(drafts) > 1 else drafts

    monkeypatch.setattr(decoding, "_drafts", oracle)
    engine = Engine.open(pack, ServeConfig(ctx=256, spec="lookup", spec_window=4))
    got = engine.generate(LOOPY, GREEDY)[1].generated
    assert engine.spec_stats.drafted > engine.spec_stats.accepted > 0          # windows were cut short
    assert got == want
    assert engine.forwards == engine.spec_stats.windows + 1 + (len(got) - 1 - engine.spec_stats.accepted
                                                              - engine.spec_stats.windows)   # no re-forward
    assert engine.loaded.mem.charged["verify arena"] == 0                   # every window's checkpoints freed


def test_the_verify_arena_holds_a_checkpoint_per_draft_of_every_deltanet_layer():
    import json
    from pathlib import Path
    from moefit.config import ModelConfig
    from moefit.memory.footprint import from_config
    raw = json.loads((Path(__file__).parent.parent / "configs" / "qwen3.6-35b-a3b.json").read_text())
    fp = from_config(ModelConfig.from_hf(raw), "int4", "bf16")
    plain = 5 * (fp.activation_bytes_per_token() + 4 * fp.model.vocab_size)
    assert fp.verify_arena_bytes(4) - plain == 4 * 30 * 32 * 128 * 128 * 4              # 240 MiB


def test_prefix_reuse_resumes_only_where_the_recurrent_state_is(packs):
    pack = packs("qwen3_5_moe")
    engine = Engine.open(pack, ServeConfig(ctx=256, prefill_chunk=16))
    first = LOOPY[:50]
    out = engine.generate(first, GREEDY)[1].generated
    continued = first + out + [3, 4]                            # a chat turn: everything so far, then more
    assert engine.generate(continued, GREEDY)[1].cached_tokens == len(first) + len(out) - 1
    fresh = Engine.open(pack, ServeConfig(ctx=256, prefill_chunk=16))
    assert engine.last.generated == fresh.generate(continued, GREEDY)[1].generated
    edited = first[:30] + [7, 7, 7]                             # diverges where no state was kept: starts over
    got = engine.generate(edited, GREEDY)[1]
    assert got.cached_tokens in (0, 16) and got.generated == fresh.generate(edited, GREEDY)[1].generated


def test_the_multimodal_checkpoint_packs_its_text_model(checkpoints, packs, tmp_path):
    """Qwen3.6 ships as Qwen3_5MoeForConditionalGeneration: config under text_config, weights
    under model.language_model.*, a vision tower and MTP layers beside them."""
    import json
    import shutil
    from safetensors.torch import load_file, save_file
    from moefit.pack.convert import convert
    src, wrapped = checkpoints["qwen3_5_moe"], tmp_path / "wrapped"
    shutil.copytree(src, wrapped, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    tensors = {}
    for f in src.glob("*.safetensors"):
        tensors.update(load_file(f))
    tensors = {(k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): v
               for k, v in tensors.items()}
    tensors |= {"model.visual.patch_embed.proj.weight": torch.zeros(4, 4), "mtp.fc.weight": torch.zeros(4, 4)}
    save_file(tensors, wrapped / "model.safetensors")
    text = json.loads((src / "config.json").read_text())
    (wrapped / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe", "text_config": text,
                                                     "architectures": ["Qwen3_5MoeForConditionalGeneration"]}))
    convert(wrapped, tmp_path / "pack", "fp32", progress=False)
    got = Engine.open(tmp_path / "pack", ServeConfig(ctx=128)).generate(LOOPY[:20], GREEDY)[1].generated
    assert got == Engine.open(packs("qwen3_5_moe"), ServeConfig(ctx=128)).generate(LOOPY[:20], GREEDY)[1].generated


def test_a_chat_turn_resumes_at_the_prompts_end_after_speculative_windows(packs):
    """The next turn of a chat re-renders the reply (a template drops its thinking, a client
    reformats a tool call), so it shares the last prompt and only part of the reply. Verify
    windows move the recurrent layers' snapshot past that point: without the state kept at the
    prompt's end the whole conversation ran again (cached_tokens 0)."""
    pack = packs("qwen3_5_moe")
    cfg = ServeConfig(ctx=256, prefill_chunk=16, spec="lookup", spec_window=4)
    engine = Engine.open(pack, cfg)
    first = LOOPY[:50]
    out = engine.generate(first, GREEDY)[1].generated
    assert engine.spec_stats.windows > 0
    continued = first + out[:3] + [3, 4]                        # the reply re-rendered differently from token 3
    got = engine.generate(continued, GREEDY)[1]
    assert got.cached_tokens == len(first)
    assert got.generated == Engine.open(pack, cfg).generate(continued, GREEDY)[1].generated
    assert engine.loaded.kv.host_bytes() > 0                     # the prompt-end states live in host memory


def test_the_same_prompt_again_runs_nothing_and_gives_the_same_reply(packs):
    """A regenerated reply or a retried call sends the same prompt: its end's state, logits and
    hidden state were kept, so no forward runs before the first new token (a hybrid after verify
    windows went back to 0), and greedy output is the same."""
    pack = packs("qwen3_5_moe")
    engine = Engine.open(pack, ServeConfig(ctx=256, prefill_chunk=16, spec="lookup", spec_window=4))
    first = LOOPY[:50]
    out = engine.generate(first, GREEDY)[1].generated
    forwards = engine.forwards
    again = engine.generate(first, SamplingParams(max_tokens=1, temperature=0))[1]
    assert again.cached_tokens == len(first) and engine.forwards == forwards and again.generated == out[:1]
    assert engine.generate(first, GREEDY)[1].generated == out

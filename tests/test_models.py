"""Parity with transformers' own forward on the same weights, for every family."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from moefit.config import ServeConfig
from moefit.runtime.engine import Engine
from moefit.runtime.sampler import SamplingParams

from conftest import FAMILIES
import tiny

PROMPT = torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(7)).tolist()


def reference(hf_dir):
    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_and_teacher_forced_decode_match_transformers(family, checkpoints, packs):
    ref = reference(checkpoints[family])
    engine = Engine.open(packs(family), ServeConfig(ctx=128, prefill_chunk=16))
    forced = torch.randint(3, 300, (16,), generator=torch.Generator().manual_seed(8)).tolist()
    with torch.no_grad():
        want = ref(torch.tensor([PROMPT + forced])).logits[0]                    # [T, V]
    got_prefill, _ = engine.prefill(PROMPT)                                      # chunked: 16 + 16 + 8
    assert torch.allclose(got_prefill, want[len(PROMPT) - 1], atol=1e-4, rtol=0)
    for i, tok in enumerate(forced):
        got = engine.decode_step(tok, len(PROMPT) + i)
        assert torch.allclose(got, want[len(PROMPT) + i], atol=1e-4, rtol=0), f"decode step {i}"


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_match_transformers_generate(family, checkpoints, packs):
    ref = reference(checkpoints[family])
    want = ref.generate(torch.tensor([PROMPT]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                        pad_token_id=0)[0, len(PROMPT):].tolist()
    engine = Engine.open(packs(family), ServeConfig(ctx=128))
    _, stats, _ = engine.generate(PROMPT, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    assert stats.generated == want


@pytest.mark.parametrize("family,extra", [("qwen3_moe", {}), ("deepseek_v3", {"mscale": 1.0, "mscale_all_dim": 1.0})])
def test_yarn_rope_matches_transformers(family, extra, tmp_path):
    """DeepSeek's YaRN also scales the softmax by mscale_all_dim's mscale squared."""
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "rope_theta": 10000.0,
            **extra}
    hf = tiny.build_checkpoint(family, tmp_path / "hf", rope_scaling=rope, max_position_embeddings=512)
    from moefit.pack.convert import convert
    convert(hf, tmp_path / "pack", "fp32", progress=False)
    long_prompt = (PROMPT * 6)[:200]                                           # past the original 128
    with torch.no_grad():
        want = reference(hf)(torch.tensor([long_prompt])).logits[0, -1]
    got, _ = Engine.open(tmp_path / "pack", ServeConfig(ctx=256)).prefill(long_prompt)
    assert torch.allclose(got, want, atol=1e-4, rtol=0)


def dequantised_reference(family, hf_dir, pack_dir):
    """transformers' model with every expert replaced by the pack's dequantised weights."""
    from moefit.pack.quant import dequantize
    from moefit.pack.reader import Pack
    model, pack = reference(hf_dir), Pack.open(pack_dir)
    with torch.no_grad():
        for (layer, e), blob in pack.blobs.items():
            parts = pack.expert_parts(layer, e)
            experts = model.model.layers[layer].mlp.experts
            gate_up = dequantize(parts, "gate_up", blob.quant, torch.float32)
            down = dequantize(parts, "down", blob.quant, torch.float32)
            if family == "gpt_oss":                         # [E, 2I] with gate / up interleaved
                gate, up = gate_up.chunk(2)
                gate_up, down = torch.stack((gate, up), dim=1).reshape(gate_up.shape).T, down.T
            experts.gate_up_proj[e], experts.down_proj[e] = gate_up, down
    return model


@pytest.mark.parametrize("path", ["torch", "native"])
@pytest.mark.parametrize("quant", ["int8", "int4", "mixed"])
@pytest.mark.parametrize("family", FAMILIES)
def test_quantised_packs_match_the_dequantised_model(family, quant, path, checkpoints, packs, monkeypatch):
    """The torch path (dequantise, then matmul) is exact to 1e-4; the native kernel also
    quantises activations to int8 per block of 32 (exact to 1e-5 against that reference in
    test_kernels.py), which costs ~1 % of the logits end to end and must not move the argmax
    (the hybrid's DeltaNet state carries that rounding from token to token: 3-4.5 % there)."""
    from moefit import kernels
    if path == "torch":
        monkeypatch.setattr(kernels, "_lib", False)
    elif kernels.library() is None:
        pytest.skip("the native kernel is not built")
    ref = dequantised_reference(family, checkpoints[family], packs(family, quant))
    with torch.no_grad():
        want = ref(torch.tensor([PROMPT])).logits[0, -1]
    got, _ = Engine.open(packs(family, quant), ServeConfig(ctx=128)).prefill(PROMPT)
    if path == "torch":
        assert torch.allclose(got, want, atol=1e-4, rtol=0)
    else:
        bound = 0.05 if family in ("qwen3_5_moe", "qwen3_next") else 0.03
        assert (got - want).norm() / want.norm() < bound and got.argmax() == want.argmax()


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_quantisation_error_is_small_against_fp32(quant, checkpoints, packs):
    with torch.no_grad():
        exact = reference(checkpoints["mixtral"])(torch.tensor([PROMPT])).logits[0, -1]
    got, _ = Engine.open(packs("mixtral", quant), ServeConfig(ctx=128)).prefill(PROMPT)
    # int4 keeps ~8 % RMS weight error on Gaussian weights (step = absmax/7 per group of 32);
    # three layers compound it, so the bound on the logits is looser than on one matrix.
    # int8 also quantises activations (q8 per block of 32) in the native kernel: ~1.5 % here.
    rel = (got - exact).norm() / exact.norm()
    assert rel < {"int8": 0.025, "int4": 0.25}[quant]
    if quant == "int8":                                  # int4 may move a near-tie; int8 must not
        assert got.argmax() == exact.argmax()


def test_int8_kv_cache_stays_close_and_runs_to_the_context_end(packs):
    fp = Engine.open(packs("qwen3_moe"), ServeConfig(ctx=64))
    q8 = Engine.open(packs("qwen3_moe"), ServeConfig(ctx=64, kv_dtype="int8"))
    a, _ = fp.prefill(PROMPT)
    b, _ = q8.prefill(PROMPT)
    assert (a - b).abs().max() < 0.05 * a.abs().max()
    _, stats, reason = q8.generate(PROMPT, SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
    assert reason == "length" and len(PROMPT) + len(stats.generated) == 64


def test_an_fp8_block_quantised_deepseek_checkpoint_is_dequantised_at_pack_time(checkpoints, tmp_path):
    """DeepSeek-V3 ships e4m3 weights with a fp32 `weight_scale_inv` per [128, 128] block (here
    [16, 16], so the tiny matrices have several blocks and ragged edges). The reference is
    transformers on a checkpoint holding the same dequantised values."""
    import json
    import shutil
    from safetensors.torch import load_file, save_file
    from moefit.pack.convert import convert
    src, fp8, deq = checkpoints["deepseek_v3"], tmp_path / "fp8", tmp_path / "dequantised"
    for d in (fp8, deq):
        shutil.copytree(src, d, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    tensors = {}
    for f in src.glob("*.safetensors"):
        tensors.update(load_file(f))
    quantised, dequantised = {}, {}
    for k, w in tensors.items():
        if w.dim() != 2 or "norm" in k or "embed" in k or "lm_head" in k or "mlp.gate." in k:
            quantised[k] = dequantised[k] = w
            continue
        scale = torch.stack([torch.stack([w[r:r + 16, c:c + 16].abs().max() / 448 for c in range(0, w.shape[1], 16)])
                             for r in range(0, w.shape[0], 16)]).clamp(min=1e-12)
        full = scale.repeat_interleave(16, 0)[:w.shape[0]].repeat_interleave(16, 1)[:, :w.shape[1]]
        codes = (w / full).to(torch.float8_e4m3fn)
        quantised[k], quantised[k + "_scale_inv"] = codes, scale
        dequantised[k] = (codes.float() * full).to(torch.bfloat16).float()
    save_file(quantised, fp8 / "model.safetensors")
    save_file(dequantised, deq / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [16, 16]}
    (fp8 / "config.json").write_text(json.dumps(cfg))
    assert sum(k.endswith("_scale_inv") for k in quantised) > 20
    convert(fp8, tmp_path / "pack", "fp32", progress=False)
    with torch.no_grad():
        want = reference(deq)(torch.tensor([PROMPT])).logits[0, -1]
    got, _ = Engine.open(tmp_path / "pack", ServeConfig(ctx=128)).prefill(PROMPT)
    assert torch.allclose(got, want, atol=1e-4, rtol=0)


def test_gpt_oss_mxfp4_experts_are_read_exactly(checkpoints, tmp_path):
    """gpt-oss ships its experts as MXFP4 (`*_blocks`, `*_scales`); the reference is transformers'
    own dequantisation (integrations.mxfp4.convert_moe_packed_tensors) of the same blocks."""
    import shutil
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    from moefit.pack.convert import convert
    src, out = checkpoints["gpt_oss"], tmp_path / "mxfp4"
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    tensors = {}
    for f in src.glob("*.safetensors"):
        tensors.update(load_file(f))
    gen = torch.Generator().manual_seed(4)
    packed = {}
    for key in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        n, cols, rows = tensors.pop(key).shape                        # the model's [N, in, out]
        packed[key + "_blocks"] = torch.randint(0, 256, (n, rows, cols // 32, 16), generator=gen, dtype=torch.uint8)
        packed[key + "_scales"] = torch.randint(122, 127, (n, rows, cols // 32), generator=gen, dtype=torch.uint8)
    save_file(tensors | packed, out / "model.safetensors")
    convert(out, tmp_path / "pack", "fp32", progress=False)
    ref = reference(src)
    with torch.no_grad():
        params = dict(ref.named_parameters())
        for key in [k[:-len("_blocks")] for k in packed if k.endswith("_blocks")]:
            params[key].copy_(convert_moe_packed_tensors(packed[key + "_blocks"], packed[key + "_scales"],
                                                         dtype=torch.float32))
        want = ref(torch.tensor([PROMPT])).logits[0, -1]
    got, _ = Engine.open(tmp_path / "pack", ServeConfig(ctx=128)).prefill(PROMPT)
    assert torch.allclose(got, want, atol=1e-4 * want.abs().max(), rtol=0)


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe_lite"])
def test_mla_under_dense_quant_holds_kv_b_per_head_and_charges_it_exactly(family, packs, card):
    """int8: kv_b held as each head's W_uk^T and W_uv, stacked and quantised, the dense line charged
    exactly what the footprint says, and the logits within int8's error of fp32's; int4 (the tiny
    models' nope dims, 16 and 24, are not whole groups of 32): kv_b's slices in fp32, and charged
    as the footprint says too."""
    from moefit.memory import ledger as L
    from moefit.models.layers import QWeight
    pack = packs(family, "int8")
    exact = Engine.open(pack, ServeConfig(ctx=64)).prefill(PROMPT)[0]
    for quant, split in (("int8", True), ("int4", False)):
        engine = Engine.open(pack, ServeConfig(device=f"sim:{card(16)}", ctx=64, dense_quant=quant, vram_reserve_mib=1,
                                               low_headroom_mib=0, min_expert_slots=0))
        layer = engine.model.layers[0]
        assert isinstance(layer["w_uk"], QWeight) == isinstance(layer["w_uv"], QWeight) == split
        assert engine.loaded.mem.charged[L.DENSE] == engine.loaded.plan.line(L.DENSE).bytes, quant
        got = engine.prefill(PROMPT)[0]
        assert (got - exact).norm() / exact.norm() < (0.05 if quant == "int8" else 0.6)    # int8 ~0.043, int4 ~0.45


@pytest.mark.parametrize("kv_dtype", ["q4", "k8v4"])
def test_mla_keeps_its_latent_in_rotated_4_bit_rows(kv_dtype, tmp_path, monkeypatch):
    """q4 rows are stored Hadamard-rotated (runtime/kv_codecs.py): MLA turns its query's latent and
    rope parts into each store's rotated space and its output back, so a q4 (or k8v4) cache gives
    the float cache's logits within 4 bits' error (as GQA's q4 on these tiny models: 0.15), and
    decode steps the same through the latent kernel as through torch's route."""
    from moefit.kernels import rows
    from moefit.pack.convert import convert
    hf = tiny.build_checkpoint("glm4_moe_lite", tmp_path / "hf", qk_rope_head_dim=32, kv_lora_rank=64)
    convert(hf, tmp_path / "pack", "fp32", progress=False)
    forced = PROMPT[:8]

    def logits(kv):
        engine = Engine.open(tmp_path / "pack", ServeConfig(ctx=128, kv_dtype=kv, prefill_chunk=16))
        out = [engine.prefill(PROMPT)[0]]
        return torch.stack(out + [engine.decode_step(tok, len(PROMPT) + i) for i, tok in enumerate(forced)])

    exact, native = logits("fp32"), logits(kv_dtype)
    assert float((native[0] - exact[0]).norm() / exact[0].norm()) < 0.2      # 0.13-0.14; 0.34 with q unturned
    monkeypatch.setattr(rows, "attend_stored", lambda *a, **kw: None)
    assert float((logits(kv_dtype) - native).abs().max() / native.abs().max()) < 1e-4


@pytest.mark.parametrize("path", ["torch", "native"])
@pytest.mark.parametrize("family", FAMILIES)
def test_dense_quant_int8_keeps_every_familys_logits_and_quantises_no_bias(family, path, packs, monkeypatch):
    """--dense-quant int8 quantises the dense matrices only: a bias stays a tensor even where it is one
    (gpt-oss's experts' biases are [N, E] per layer, read an expert's row at a time: quantised, the
    torch path and a prompt's busy experts failed), and the logits stay within int8's error (the
    tiny hybrids are touchy: Gaussian noise of int8 rounding's size on their DeltaNet out_proj alone
    moves their logits by 7 %; 0.07-0.17 here, 0.01-0.05 elsewhere)."""
    from moefit import kernels
    from moefit.models.layers import QWeight
    if path == "torch":
        monkeypatch.setattr(kernels, "_lib", False)
    elif kernels.library() is None:
        pytest.skip("the native kernel is not built")
    pack = packs(family, "int8")
    exact = Engine.open(pack, ServeConfig(ctx=128)).prefill(PROMPT)[0]
    engine = Engine.open(pack, ServeConfig(ctx=128, dense_quant="int8", prefill_chunk=16))
    quantised = {k for layer in engine.model.layers if isinstance(layer, dict)
                 for k, v in layer.items() if isinstance(v, QWeight)}
    assert quantised and not {k for k in quantised if "bias" in k}
    got = engine.prefill(PROMPT)[0]
    bound = 0.25 if family in ("qwen3_5_moe", "qwen3_next") else 0.06
    assert (got - exact).norm() / exact.norm() < bound and got.argmax() == exact.argmax()

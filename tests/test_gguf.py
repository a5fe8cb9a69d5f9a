"""GGUF import: tiny checkpoints written as llama.cpp lays them out (gguf.GGUFWriter,
tests/gguf_writer.py), packed by `moefit pack MODEL.gguf`, against transformers on the same weights."""


import numpy as np
import pytest
import torch

from moefit.config import ServeConfig
from moefit.errors import PackError
from moefit.pack.convert import convert
from moefit.runtime.engine import Engine

import tiny

gguf = pytest.importorskip("gguf")
PROMPT = torch.randint(3, 300, (30,), generator=torch.Generator().manual_seed(9)).tolist()


def write_gguf(hf_dir, path, expert_type=None, down_type=None):
    """The checkpoint as convert_hf_to_gguf.py would write a qwen3moe file (F32, or experts in
    `expert_type`, down in `down_type`): tests/gguf_writer.py."""
    from gguf_writer import write_gguf as write
    return write(hf_dir, path, "qwen3_moe", expert_type, down_type)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return tiny.build_checkpoint("qwen3_moe", tmp_path_factory.mktemp("gguf") / "hf", mlp_only_layers=[])


def test_a_gguf_file_packs_and_matches_transformers(hf, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    header = convert(write_gguf(hf, tmp_path / "tiny.gguf"), tmp_path / "pack", "fp32", progress=False)
    import hashlib
    source = header["model_config"]["moefit_source"]
    assert source["types"] == {"F32": 3 * (9 + 3) + 3}                     # layers x (dense + experts) + top
    assert source["sha256"] == hashlib.sha256((tmp_path / "tiny.gguf").read_bytes()).hexdigest()
    assert source["tensor_types"]["blk.0.ffn_gate_exps.weight"] == "F32"
    engine = Engine.open(tmp_path / "pack", ServeConfig(ctx=128))
    ref = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref(torch.tensor([PROMPT])).logits[0, -1]
    got, _ = engine.prefill(PROMPT)
    assert torch.allclose(got, want, atol=1e-4, rtol=0)
    hf_tok = AutoTokenizer.from_pretrained(hf)
    for text in ("the lantern burns in the night", "define: lantern\n  A river's  end!", "<|endoftext|>x"):
        assert engine.codec.encode(text) == hf_tok.encode(text), text


def test_q8_0_experts_are_dequantised_from_their_blocks(hf, tmp_path):
    convert(write_gguf(hf, tmp_path / "f32.gguf"), tmp_path / "f32", "fp32", progress=False)
    q8 = convert(write_gguf(hf, tmp_path / "q8.gguf", gguf.GGMLQuantizationType.Q8_0), tmp_path / "q8", "fp32",
                 progress=False)
    assert q8["model_config"]["moefit_source"]["types"]["Q8_0"] == 9                 # 3 layers x 3 expert tensors
    a, _ = Engine.open(tmp_path / "f32", ServeConfig(ctx=64)).prefill(PROMPT)
    b, _ = Engine.open(tmp_path / "q8", ServeConfig(ctx=64)).prefill(PROMPT)
    assert 0 < (a - b).norm() / a.norm() < 0.02 and a.argmax() == b.argmax()


def test_the_fast_reader_reads_what_gguf_pys_reader_reads(hf, tmp_path):
    """moefit's GGUF reader (pack/gguf_file.py) against gguf-py's GGUFReader: every metadata value
    (each scalar type, strings, arrays of numbers and of strings, Qwen3's vocabulary of over 150,000
    tokens and its merges), every tensor's name, type, dims and bytes (F32, F16, Q8_0, Q4_K and Q6_K blocks);
    a file cut short is refused."""
    from gguf_writer import write_gguf as write
    from moefit.pack.gguf_file import GGUFFile
    t = gguf.GGMLQuantizationType
    model = write(hf, tmp_path / "q4km.gguf", "qwen3_moe", t.Q4_K, t.Q6_K)
    w = gguf.GGUFWriter(str(tmp_path / "kinds.gguf"), "qwen3moe")
    for i, (adder, value) in enumerate([(w.add_uint8, 7), (w.add_int8, -7), (w.add_uint16, 65535), (w.add_int16, -300),
                                        (w.add_uint32, 1 << 31), (w.add_int32, -(1 << 30)), (w.add_float32, 0.1),
                                        (w.add_uint64, 1 << 40), (w.add_int64, -(1 << 40)), (w.add_float64, 1e-300),
                                        (w.add_bool, True), (w.add_string, "ça va: 模型")]):
        adder(f"k.{i}", value)
    w.add_array("k.ints", [1, -2, 3])
    w.add_array("k.floats", [0.5, -1.25])
    w.add_array("k.empty", [])
    w.add_tensor("a.weight", np.arange(12, dtype=np.float16).reshape(3, 4))
    w.add_tensor("b.weight", np.arange(64, dtype=np.float32).reshape(2, 32))
    w.add_tensor("c.weight", gguf.quants.quantize(np.linspace(-1, 1, 64, dtype=np.float32).reshape(2, 32), t.Q8_0),
                 raw_dtype=t.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    vocab = _tokenizer_only_gguf(tiny.real_tokenizer("qwen-3", tmp_path / "qwen"), tmp_path / "tok.gguf", "qwen2")
    for path in (model, tmp_path / "kinds.gguf", vocab):
        ours, theirs = GGUFFile(path), gguf.GGUFReader(str(path))
        want = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
        assert ours.meta == want and list(ours.meta) == list(want), path
        assert [(a.name, a.tensor_type, a.shape.tolist(), a.data.dtype, a.data.shape) for a in ours.tensors] == \
            [(b.name, b.tensor_type, b.shape.tolist(), b.data.dtype, b.data.shape) for b in theirs.tensors], path
        assert all(np.array_equal(a.data, b.data) for a, b in zip(ours.tensors, theirs.tensors)), path
    assert len(GGUFFile(vocab).meta["tokenizer.ggml.tokens"]) > 150_000
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(model.read_bytes()[:-100])
    with pytest.raises(ValueError, match="past the end"):
        GGUFFile(cut)
    with pytest.raises(PackError, match="not a readable GGUF file"):
        convert(cut, tmp_path / "pack", "int8", progress=False)


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "MXFP4", "Q8_0"])
def test_a_gguf_matrix_is_dequantised_natively_as_gguf_quants_does(kind, monkeypatch):
    """`moefit pack` turns a file's dense matrices (and experts it requantises) to floats: the block
    types the host kernel takes through it (kernels/dequant.h, over the pool), the same numbers as
    gguf.quants', which the others (Q8_0's raw blocks) and a host without the kernel still use."""
    from gguf_writer import super_blocks
    from moefit import kernels
    from moefit.pack import gguf_source
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    raw = super_blocks((24, 512), qtype, 3) if kind != "Q8_0" else \
        gguf.quants.quantize(np.linspace(-2, 2, 24 * 512, dtype=np.float32).reshape(24, 512), qtype)
    want = torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32))
    calls = []
    native = kernels.dequantize
    monkeypatch.setattr(kernels, "dequantize", lambda *a, **k: calls.append(a[2]) or native(*a, **k))
    got = gguf_source._dequantised(raw, qtype, (24, 512))
    assert torch.equal(got, want) and calls == ([kind.lower()] if kind != "Q8_0" and kernels.library() else [])
    monkeypatch.setattr(kernels, "dequantize", lambda *a, **k: None)               # no kernel: gguf.quants
    assert torch.equal(gguf_source._dequantised(raw, qtype, (24, 512)), want)


def test_an_unsupported_architecture_is_named(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "llama4")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(PackError, match="architecture 'llama4' is not supported yet"):
        convert(tmp_path / "x.gguf", tmp_path / "pack", "int8", progress=False)


@pytest.mark.parametrize("kind, quant", [("Q4_0", "int4"), ("Q8_0", "q8_0"), ("MXFP4", "q8_0"), ("MXFP4", "keep")])
def test_q4_0_and_q8_0_experts_keep_their_blocks(kind, quant, hf, tmp_path):
    """Q4_0 is moefit's int4 layout up to nibble order, Q8_0 its q8_0 layout, MXFP4 stays its blocks
    (or converts to q8_0 without loss when asked): packed so, the experts are bit for bit llama.cpp's
    weights (dequantised by the pack's own code against gguf.quants)."""
    from moefit.pack.quant import dequantize
    from moefit.pack.reader import Pack
    path = write_gguf(hf, tmp_path / "q.gguf", getattr(gguf.GGMLQuantizationType, kind))
    convert(path, tmp_path / "pack", quant, progress=False)
    pack, reader = Pack.open(tmp_path / "pack"), gguf.GGUFReader(str(path))
    raw = {t.name: t for t in reader.tensors}
    for layer, e in ((0, 0), (2, 7)):
        parts = pack.expert_parts(layer, e)
        gate = raw[f"blk.{layer}.ffn_gate_exps.weight"]
        want = gguf.quants.dequantize(np.asarray(gate.data[e]), gate.tensor_type)
        got = dequantize(parts, "gate_up", pack.blobs[(layer, e)].quant, torch.float32)[:want.shape[0]]
        assert torch.equal(got, torch.from_numpy(np.array(want, dtype=np.float32)))
    assert pack.blobs[(0, 0)].quant == {"keep": "mxfp4"}.get(quant, quant)            # MXFP4 kept as its blocks
    engine = Engine.open(tmp_path / "pack", ServeConfig(ctx=64))
    assert torch.isfinite(engine.prefill(PROMPT)[0]).all()


@pytest.fixture(scope="module")
def hf256(tmp_path_factory):
    """Super-blocks hold 256 weights: hidden and expert size a multiple of 256."""
    return tiny.build_checkpoint("qwen3_moe", tmp_path_factory.mktemp("gguf256") / "hf", mlp_only_layers=[],
                                 hidden_size=256, moe_intermediate_size=256, intermediate_size=256)


@pytest.mark.parametrize("kinds, quant", [(("Q4_K",), "q4_k"), (("Q5_K",), "q5_k"), (("Q6_K",), "q6_k"),
                                          (("IQ4_XS",), "iq4_xs"), (("Q4_K", "Q6_K"), "q4_k/q6_k")])
def test_k_quant_and_iq4_xs_experts_keep_their_super_blocks(kinds, quant, hf256, tmp_path):
    """Q4_K, Q5_K, Q6_K and IQ4_XS experts (and a Q4_K_M-style layer: gate and up Q4_K, down Q6_K)
    pack by default as the file's super-blocks, byte for byte; their weights, dequantised by the
    pack's code, are gguf.quants' own; the host kernel multiplies them as the torch path does."""
    from moefit.pack.quant import dequantize
    from moefit.pack.reader import Pack
    types = [getattr(gguf.GGMLQuantizationType, k) for k in kinds]
    path = write_gguf(hf256, tmp_path / "k.gguf", types[0], types[-1] if len(types) > 1 else None)
    header = convert(path, tmp_path / "pack", progress=False)
    assert set(header["quant"]["layers"].values()) == {quant}
    pack, reader = Pack.open(tmp_path / "pack"), gguf.GGUFReader(str(path))
    raw = {t.name: t for t in reader.tensors}
    for layer, e in ((0, 0), (2, 7)):
        parts = pack.expert_parts(layer, e)
        for name, part, rows in (("ffn_gate_exps", "gate_up", slice(0, 256)),
                                 ("ffn_up_exps", "gate_up", slice(256, None)), ("ffn_down_exps", "down", slice(None))):
            t = raw[f"blk.{layer}.{name}.weight"]
            assert np.array_equal(parts[part][rows].numpy(), np.asarray(t.data[e]))               # the bytes
            want = gguf.quants.dequantize(np.asarray(t.data[e]), t.tensor_type)
            got = dequantize(parts, part, quant, torch.float32)[rows]
            assert torch.equal(got, torch.from_numpy(np.array(want, dtype=np.float32)))        # the weights
    native = Engine.open(tmp_path / "pack", ServeConfig(ctx=64))
    logits = native.prefill(PROMPT)[0]
    from moefit import kernels
    usable = kernels.usable
    try:
        kernels.usable = lambda x, q: False                    # the torch path: dequantise, then matmul
        reference = Engine.open(tmp_path / "pack", ServeConfig(ctx=64)).prefill(PROMPT)[0]
    finally:
        kernels.usable = usable
    assert torch.isfinite(logits).all() and (logits - reference).abs().max() < 0.05 * reference.abs().max()


def test_a_split_gguf_packs_from_any_of_its_parts(hf, tmp_path):
    """gguf-split's layout: NAME-0000i-of-0000N.gguf, the metadata in the first part, tensors spread."""
    whole = gguf.GGUFReader(str(write_gguf(hf, tmp_path / "whole.gguf")))
    tensors = list(whole.tensors)
    halves = (tensors[: len(tensors) // 2], tensors[len(tensors) // 2:])
    for i, part in enumerate(halves, start=1):
        w = gguf.GGUFWriter(str(tmp_path / f"tiny-{i:05d}-of-00002.gguf"), "qwen3moe")
        if i == 1:
            for field in whole.fields.values():
                if field.name.startswith(("qwen3moe.", "tokenizer.")):
                    w.add_key_value(field.name, field.contents(), field.types[0],
                                    field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None)
        w.add_uint16("split.no", i - 1)
        w.add_uint16("split.count", 2)
        for t in part:
            w.add_tensor(t.name, np.array(t.data), raw_shape=tuple(reversed(t.shape.tolist())), raw_dtype=t.tensor_type)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    convert(tmp_path / "tiny-00002-of-00002.gguf", tmp_path / "split", "fp32", progress=False)
    convert(tmp_path / "whole.gguf", tmp_path / "one", "fp32", progress=False)
    a, _ = Engine.open(tmp_path / "split", ServeConfig(ctx=64)).prefill(PROMPT)
    b, _ = Engine.open(tmp_path / "one", ServeConfig(ctx=64)).prefill(PROMPT)
    assert torch.equal(a, b)
    (tmp_path / "tiny-00001-of-00002.gguf").unlink()
    with pytest.raises(PackError, match="split GGUF parts missing: tiny-00001-of-00002.gguf"):
        convert(tmp_path / "tiny-00002-of-00002.gguf", tmp_path / "split2", "fp32", progress=False)


# the families llama.cpp names otherwise: written as its converter writes them (tests/gguf_writer.py);
# each as llama.cpp's converter really writes it is checked by bench/gguf_families.py against llama.cpp
ARCH_FIXTURES = {"mixtral": {}, "olmoe": {"num_key_value_heads": 4, "rms_norm_eps": 1e-5},
                 "glm4_moe": {}, "deepseek_v3": {}, "gpt_oss": {}, "qwen3_5_moe": {},
                 "glm4_moe_lite": {"mlp_layer_types": ["dense", "sparse", "sparse"]}}


@pytest.mark.parametrize("family", list(ARCH_FIXTURES))
def test_each_llama_cpp_architecture_packs_and_matches_transformers(family, tmp_path):
    from transformers import AutoModelForCausalLM
    from gguf_writer import ARCH, write_gguf
    hf_dir = tiny.build_checkpoint(family, tmp_path / "hf", **ARCH_FIXTURES[family])
    path = write_gguf(hf_dir, tmp_path / f"{family}.gguf", family)
    header = convert(path, tmp_path / "pack", "fp32", progress=False)
    assert header["model_config"]["model_type"] in (family, family + "_text")
    assert header["model_config"]["moefit_source"]["gguf"] == path.name
    engine = Engine.open(tmp_path / "pack", ServeConfig(ctx=128, prefill_chunk=len(PROMPT)))
    ref = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref(torch.tensor([PROMPT])).logits[0]
    got = engine.forward(PROMPT, 0)
    assert torch.allclose(got, want, atol=1e-4, rtol=0), f"{ARCH[family].name}: {float((got - want).abs().max())}"


def test_a_deepseek2_file_without_gating_is_glm_flash_or_refused_as_deepseek_v2(tmp_path):
    """llama.cpp's converter writes no gating key for deepseek2; llama.cpp reads such a file as
    DeepSeek-V2's softmax routing unless it is GLM-4.7-Flash's (sigmoid). moefit does the same,
    and refuses the softmax it does not run rather than route with the wrong function."""
    from gguf_writer import write_gguf
    hf_dir = tiny.build_checkpoint("deepseek_v3", tmp_path / "hf")
    path = write_gguf(hf_dir, tmp_path / "v2.gguf", "deepseek_v3", gating=False)
    with pytest.raises(PackError, match="expert gating 'softmax'.*not supported"):
        convert(path, tmp_path / "pack", "fp32", progress=False)
    lite = tiny.build_checkpoint("glm4_moe_lite", tmp_path / "lite", mlp_layer_types=["dense", "sparse", "sparse"])
    header = convert(write_gguf(lite, tmp_path / "flash.gguf", "glm4_moe_lite"), tmp_path / "flash", "fp32",
                     progress=False)
    assert header["model_config"]["model_type"] == "glm4_moe_lite"
    assert header["model_config"]["scoring_func"] == "sigmoid"


def test_by_default_a_gguf_file_keeps_its_blocks_and_names_what_it_cannot(hf, tmp_path):
    """No silent re-quantisation: Q8_0 experts pack as q8_0 by default; a type moefit has no layout
    for is an error naming the tensor and the type, and --requant is the way out."""
    import subprocess
    import sys
    from moefit.pack.reader import Pack
    q8 = write_gguf(hf, tmp_path / "q8.gguf", gguf.GGMLQuantizationType.Q8_0)
    header = convert(q8, tmp_path / "kept", progress=False)
    assert header["quant"]["recipe"] == "keep" and set(header["quant"]["layers"].values()) == {"q8_0"}
    assert torch.isfinite(Engine.open(tmp_path / "kept", ServeConfig(ctx=64)).prefill(PROMPT)[0]).all()
    assert Pack.open(tmp_path / "kept").blobs[(0, 0)].quant == "q8_0"
    q5 = write_gguf(hf, tmp_path / "q5.gguf", gguf.GGMLQuantizationType.Q5_0)
    with pytest.raises(PackError, match=r"blk\.0\.ffn_gate_exps\.weight is Q5_0: .* --requant int4\|int8\|q8_0"):
        convert(q5, tmp_path / "refused", progress=False)
    run = subprocess.run([sys.executable, "-m", "moefit", "pack", str(q5), "-o", str(tmp_path / "requant"),
                          "--requant", "int8"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "experts int8" in run.stdout and "Q5_0" in run.stdout
    refused = subprocess.run([sys.executable, "-m", "moefit", "pack", str(q5), "-o", str(tmp_path / "x")],
                             capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0 and "Q5_0" in refused.stderr and "Traceback" not in refused.stderr


def test_a_prompts_busy_k_quant_experts_run_as_gemms(hf256, tmp_path, monkeypatch):
    """A Q4_K_M-style layer's (gate and up Q4_K, down Q6_K) busy experts in a prompt chunk: two fp32
    GEMMs on the blocks dequantised natively, close to the dots (tests/test_quant.py)."""
    from moefit import kernels
    from moefit.experts import host_side
    from moefit.pack import quant as q
    if kernels.library() is None:
        pytest.skip("the native kernel is not built")
    path = write_gguf(hf256, tmp_path / "k.gguf", gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K)
    convert(path, tmp_path / "pack", progress=False)
    prompt = [(7 * i) % 300 + 3 for i in range(q.GEMM_TOKENS + 4)]
    calls = []
    real = host_side.gemm_first
    monkeypatch.setattr(host_side, "gemm_first", lambda x, p, name, quant: calls.append(quant) or real(x, p, name, quant))
    gemm = Engine.open(tmp_path / "pack", ServeConfig(ctx=256, expert_gemm_rows="8")).prefill(prompt)[0]
    assert set(calls) == {"q4_k/q6_k"}
    calls.clear()
    dots = Engine.open(tmp_path / "pack", ServeConfig(ctx=256, expert_gemm_rows="off")).prefill(prompt)[0]
    assert not calls
    assert torch.isfinite(gemm).all() and (gemm - dots).norm() / dots.norm() < 5e-2


def _tokenizer_only_gguf(tok_dir, path, pre: str):
    """A GGUF file holding a real tokenizer as llama.cpp's converter writes it (tokens by id, the
    added ones as CONTROL, merges as "a b") under `pre`, and no tensors."""
    import json
    t = json.loads((tok_dir / "tokenizer.json").read_text())
    by_id = {i: tok for tok, i in t["model"]["vocab"].items()}
    special = {a["id"]: a["content"] for a in t["added_tokens"]}
    n = max([*by_id, *special]) + 1
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_block_count(1)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list([special.get(i, by_id.get(i, f"[PAD{i}]")) for i in range(n)])
    w.add_token_types([3 if i in special else 1 for i in range(n)])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in t["model"]["merges"]])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("name,pre", [("qwen-3", "qwen2"), ("qwen-3.5", "qwen35"), ("glm-4.5v", "glm4"),
                                      ("glm-4.7-flash", "glm4"), ("deepseek-v3", "deepseek-v3")])
def test_a_gguf_tokenizer_splits_and_merges_as_its_own_tokenizer_json(name, pre, tmp_path):
    """GLM's digits in threes and whole-word lookups, DeepSeek-V3's three splits: the tokenizer
    moefit rebuilds from a GGUF file encodes as the model's own tokenizer.json does."""
    from tokenizers import Tokenizer
    from moefit.pack.gguf_source import GGUFSource
    tok_dir = tiny.real_tokenizer(name, tmp_path / name)
    GGUFSource(_tokenizer_only_gguf(tok_dir, tmp_path / "tok.gguf", pre)).write_tokenizer(tmp_path / "out")
    ours, theirs = (Tokenizer.from_file(str(d / "tokenizer.json")) for d in (tmp_path / "out", tok_dir))
    for text in ("The year 2026 had 1234567 tokens; I'LL say it's 3.14159!", "def f(x):\n\treturn x**2  # ok\r\n",
                 "模型在本地运行。ひらがなとカタカナ", "   leading and trailing   ", "<|endoftext|> e-mail: a@b.c",
                 "café naïve ñ हिन्दी"):
        ids = [t.encode(text, add_special_tokens=False).ids for t in (ours, theirs)]
        assert ids[0] == ids[1], text


def test_gpt_oss_s_pre_tokenizer_splits_as_o200k_does(tmp_path):
    """No o200k tokenizer.json ships offline: its documented splits instead (case changes, a
    contraction with its word, digits in threes, "/" kept after punctuation)."""
    from tokenizers import Tokenizer
    from moefit.pack.gguf_source import GGUFSource
    tok_dir = tiny.real_tokenizer("qwen-3", tmp_path / "qwen")
    GGUFSource(_tokenizer_only_gguf(tok_dir, tmp_path / "tok.gguf", "gpt-4o")).write_tokenizer(tmp_path / "out")
    split = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json")).pre_tokenizer.pre_tokenize_str
    words = [w.replace("Ġ", " ") for w, _ in split("HelloWorld they'RE at 1234567 https://x")]
    assert words == ["Hello", "World", " they'RE", " at", " ", "123", "456", "7", " https", "://", "x"]


def test_a_pre_tokenizer_moefit_does_not_know_is_said_at_pack_time(hf, tmp_path):
    from gguf_writer import write_gguf as write
    from moefit.commands.pack import describe
    known = convert(write(hf, tmp_path / "qwen.gguf", "qwen3_moe", pre="qwen2"), tmp_path / "known", "fp32",
                    progress=False)
    odd = convert(write(hf, tmp_path / "odd.gguf", "qwen3_moe", pre="smollm"), tmp_path / "odd", "fp32",
                  progress=False)
    assert "pre-tokenizer" not in describe(known)
    assert "pre-tokenizer 'smollm' is not one moefit knows" in describe(odd)

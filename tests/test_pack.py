"""The pack: round trip, streaming input spellings, and every way a pack can be broken."""

import json
import shutil
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from moefit.errors import PackError
from moefit.pack.convert import convert
from moefit.pack.reader import Pack


def test_round_trip_keeps_every_weight(checkpoints, packs):
    pack = Pack.open(packs("mixtral"))
    assert pack.model.family == "mixtral" and pack.quant["recipe"] == "fp32"
    hf = {}
    for f in checkpoints["mixtral"].glob("*.safetensors"):
        hf.update(load_file(f))
    gate, up = hf["model.layers.2.block_sparse_moe.experts.5.w1.weight"], hf["model.layers.2.block_sparse_moe.experts.5.w3.weight"]
    parts = pack.expert_parts(2, 5)
    assert torch.equal(parts["gate_up"], torch.cat([gate, up]))
    assert torch.equal(parts["down"], hf["model.layers.2.block_sparse_moe.experts.5.w2.weight"])
    assert torch.equal(pack.dense("model.layers.1.mlp.gate.weight"), hf["model.layers.1.block_sparse_moe.gate.weight"])
    assert len(pack.blobs) == 3 * 8 and all(b.offset % 4096 == 0 for b in pack.blobs.values())


def test_fused_expert_tensors_pack_like_per_expert_ones(checkpoints, packs, tmp_path):
    src = checkpoints["olmoe"]
    hf = {}
    for f in src.glob("*.safetensors"):
        hf.update(load_file(f))
    fused = {k: v for k, v in hf.items() if ".experts." not in k}
    for layer in range(3):
        p = f"model.layers.{layer}.mlp.experts."
        fused[p + "gate_up_proj"] = torch.stack([torch.cat([hf[f"{p}{e}.gate_proj.weight"], hf[f"{p}{e}.up_proj.weight"]])
                                                 for e in range(8)])
        fused[p + "down_proj"] = torch.stack([hf[f"{p}{e}.down_proj.weight"] for e in range(8)])
    out = tmp_path / "fused"
    out.mkdir()
    save_file(fused, out / "model.safetensors")
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, out / f)
    convert(out, tmp_path / "pack", "int8", progress=False)
    a, b = Pack.open(tmp_path / "pack"), Pack.open(packs("olmoe", "int8"))
    assert all(torch.equal(a.blob(*k), b.blob(*k)) for k in b.blobs)


@pytest.fixture
def broken(packs, tmp_path):
    dest = tmp_path / "broken"
    shutil.copytree(packs("qwen3_moe", "int4"), dest)
    return dest


def test_a_flipped_byte_names_the_blob(broken):
    entry = Pack.open(broken).blobs[(2, 3)]
    with open(broken / "experts.bin", "r+b") as f:
        f.seek(entry.offset + 100)
        byte = f.read(1)
        f.seek(entry.offset + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(PackError, match=r"experts\.bin: blob \(layer 2, expert 3\) fails its checksum"):
        Pack.open(broken)


def test_a_truncated_file_says_so(broken):
    size = (broken / "experts.bin").stat().st_size
    with open(broken / "experts.bin", "r+b") as f:
        f.truncate(size - 5000)
    with pytest.raises(PackError, match=r"experts\.bin: truncated .*blob \(layer 2, expert 7\)"):
        Pack.open(broken)


def test_an_unknown_format_version_is_refused(broken):
    header = json.loads((broken / "moefit-pack.json").read_text())
    header["format_version"] = 99
    (broken / "moefit-pack.json").write_text(json.dumps(header))
    with pytest.raises(PackError, match="format version 99 is not supported"):
        Pack.open(broken)


def test_a_missing_tokenizer_is_named(broken):
    (broken / "tokenizer" / "tokenizer.json").unlink()
    with pytest.raises(PackError, match=r"tokenizer\.json: missing"):
        Pack.open(broken)


def test_the_cli_reports_a_corrupt_pack_without_a_traceback(broken):
    with open(broken / "dense.bin", "r+b") as f:
        f.truncate(10)
    r = subprocess.run([sys.executable, "-m", "moefit", "generate", str(broken), "--prompt", "hi"],
                       capture_output=True, text=True)
    assert r.returncode == 1
    assert "dense.bin: truncated" in r.stderr and "Traceback" not in r.stderr


def test_an_unsupported_group_size_is_a_clear_error(checkpoints, tmp_path):
    with pytest.raises(PackError, match="group size 48 must .*divide hidden size 64"):
        convert(checkpoints["qwen3_moe"], tmp_path / "p", "int4", group_size=48, progress=False)


def test_the_cli_packs_and_generates(checkpoints, tmp_path):
    run = lambda *a: subprocess.run([sys.executable, "-m", "moefit", *a], capture_output=True, text=True)  # noqa: E731
    r = run("pack", str(checkpoints["qwen3_moe"]), "-o", str(tmp_path / "p"), "--quant", "mixed")
    assert r.returncode == 0, r.stderr
    assert "2 MoE layers x 8 experts" in r.stdout
    r = run("generate", str(tmp_path / "p"), "--prompt", "the lantern", "--max-tokens", "5", "--json",
            "--ignore-eos")
    out = json.loads(r.stdout)
    assert r.returncode == 0 and len(out["token_ids"]) == 5 and out["prompt_tokens"] > 0
    assert out["decode_tokens_per_s"] > 0 and isinstance(out["text"], str)


@pytest.mark.parametrize("damage,needle", [
    (lambda d: (d / "config.json").write_text("{not json"), "config.json: not valid JSON"),
    (lambda d: (d / "config.json").write_text('{"model_type": "llama4"}'), "model_type 'llama4' is not supported"),
    (lambda d: [f.write_bytes(f.read_bytes()[:5000]) for f in d.glob("*.safetensors")],
     "not a complete safetensors file"),
])
def test_a_broken_checkpoint_is_one_line_not_a_traceback(checkpoints, tmp_path, damage, needle):
    hf = tmp_path / "hf"
    shutil.copytree(checkpoints["olmoe"], hf)
    damage(hf)
    r = subprocess.run([sys.executable, "-m", "moefit", "pack", str(hf), "-o", str(tmp_path / "p")],
                       capture_output=True, text=True)
    assert r.returncode == 1 and needle in r.stderr and "Traceback" not in r.stderr


def _flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_a_verified_pack_skips_its_checksums_until_a_file_changes(broken, monkeypatch):
    from moefit.pack import verified
    for _ in range(2):                                       # just copied: racily clean, not remembered
        assert Pack.open(broken).verified == "checksums verified"
    monkeypatch.setattr(verified, "RACY_S", 0.0)
    time.sleep(0.05)                                         # past a timestamp's tick
    entry = Pack.open(broken).blobs[(2, 3)]
    assert Pack.open(broken).verified.startswith("unchanged since its checksums were verified")
    time.sleep(0.05)
    _flip(broken / "experts.bin", entry.offset + 100)        # a write moves the file's ctime
    with pytest.raises(PackError, match=r"blob \(layer 2, expert 3\) fails its checksum"):
        Pack.open(broken)
    assert not (broken / verified.STAMP).exists()


def test_moefit_verify_checks_every_checksum_whatever_was_remembered(broken, monkeypatch):
    from moefit.pack import verified
    entry = Pack.open(broken).blobs[(2, 5)]
    _flip(broken / "experts.bin", entry.offset + 7)
    monkeypatch.setattr(verified, "RACY_S", 0.0)
    time.sleep(0.05)
    header = json.loads((broken / "moefit-pack.json").read_text())
    assert verified.remember(broken, header, time.time())    # as if the bytes rotted after a verification
    assert Pack.open(broken).verified.startswith("unchanged since")
    r = subprocess.run([sys.executable, "-m", "moefit", "verify", str(broken)], capture_output=True, text=True)
    assert r.returncode == 1 and "blob (layer 2, expert 5) fails its checksum" in r.stderr, r.stderr
    with pytest.raises(PackError, match=r"blob \(layer 2, expert 5\)"):   # the record is gone: starts check again
        Pack.open(broken)


def test_moefit_verify_reports_a_sound_pack(packs):
    r = subprocess.run([sys.executable, "-m", "moefit", "verify", str(packs("olmoe", "int8")), "--json"],
                       capture_output=True, text=True)
    out = json.loads(r.stdout)
    assert r.returncode == 0 and out["ok"] and out["blobs"] > 0 and out["bytes"] > 0


@pytest.mark.parametrize("quant", ["q4_k/q6_k", "iq4_xs", "q5_k", "mxfp4"])
def test_a_synthetic_pack_holds_gguf_super_blocks_the_kernels_read(quant, tmp_path):
    """bench/synthetic_pack.py --quant q4_k/q6_k (a GPU machine's way to a GGUF-kept pack without
    the gguf package): random super-blocks (or MXFP4 blocks) whose weights stay about N(0, 0.02)'s size, packed as a
    file's kept experts, served by the host kernel as by torch's dequantisation."""
    import json
    import sys
    from pathlib import Path
    import torch
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench.synthetic_pack import build_pack
    from moefit.config import ServeConfig
    from moefit.pack.quant import dequantize
    from moefit.pack.reader import Pack
    from moefit.runtime.engine import Engine
    raw = json.loads((Path(__file__).resolve().parent.parent / "configs" / "qwen3-30b-a3b.json").read_text())
    raw.update(hidden_size=256, moe_intermediate_size=256, intermediate_size=256, num_experts=8, num_experts_per_tok=2,
               num_hidden_layers=2, max_window_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
               vocab_size=512)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    pack = Pack.open(build_pack(tmp_path / "config.json", tmp_path / "pack", quant))
    assert {b.quant for b in pack.blobs.values()} == {quant}
    for part in ("gate_up", "down"):
        w = dequantize(pack.expert_parts(1, 3), part, quant, torch.float32)
        assert 0.002 < float(w.std()) < 0.05, (part, float(w.std()))
    engine = Engine.open(pack, ServeConfig(ctx=64))
    logits = engine.prefill([5, 6, 7, 8])[0]
    assert torch.isfinite(logits).all()

"""The planner and the ledger: pure functions, no weights needed."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from moefit.config import ModelConfig, ServeConfig
from moefit.experts.profile import Profile
from moefit.experts.slots import slots_bytes
from moefit.memory import ledger as L
from moefit.memory.devices import DeviceSnapshot, ProcessUsage
from moefit.memory.footprint import dense_shapes, from_config, from_pack_header
from moefit.memory.planner import plan
from moefit.pack.format import read_header

from conftest import FAMILIES

CONFIGS = Path(__file__).parents[1] / "configs"  # published config.json files
MIB = L.MIB
QWEN = json.loads((CONFIGS / "qwen3-30b-a3b.json").read_text())


def card(total_mib=12282, procs=((2101, "gnome-shell", 587), (2202, "chromium", 434))):
    p = tuple(ProcessUsage(pid, n, int(m * MIB)) for pid, n, m in procs)
    return DeviceSnapshot("RTX 4070 (simulated)", total_mib * MIB, total_mib * MIB - sum(x.bytes for x in p), p)


def qwen_plan(snapshot=None, recipe="int4", **flags):
    model = ModelConfig.from_hf(QWEN)
    fp = from_config(model, recipe, "bf16")
    flags.setdefault("kv_resident", "all")                     # KV streaming has its own tests
    cfg = ServeConfig(device="sim:x", ctx=flags.pop("ctx", 32768), kv_dtype=flags.pop("kv_dtype", "int8"), **flags)
    order = Profile.empty(model.num_layers, model.num_experts).hottest_first(list(fp.blob_sizes))
    return plan(fp, cfg, snapshot or card(), order), fp


def test_ledger_lines_are_in_order_and_add_up_to_the_card():
    p, _ = qwen_plan()
    assert [x.name for x in p.lines] == [L.OTHER, L.DENSE, L.KV, L.RESERVE, L.CACHE, L.FREE]
    assert sum(x.bytes for x in p.lines) == p.device.total_bytes
    reserve = p.line(L.RESERVE)
    assert sum(x.bytes for x in reserve.parts) == reserve.bytes
    assert p.reserve.total == p.reserve.recommended and p.serve_status == "OK"


def test_expert_cache_n_is_a_byte_budget_so_mixed_blobs_load_more_slots():
    p, fp = qwen_plan(recipe="mixed", expert_cache="400")
    assert p.cache_budget == slots_bytes(400, fp.largest_blob)              # 400 slots of the largest blob
    assert 400 * fp.largest_blob < p.cache_budget < 1.01 * 400 * fp.largest_blob
    assert p.slots > 400 and p.cache_used <= p.cache_budget


def test_auto_takes_what_is_left_and_a_dirty_card_gets_less():
    clean, _ = qwen_plan()
    dirty, _ = qwen_plan(card(procs=((2101, "gnome-shell", 587), (3000, "moefit", 5000), (3100, "chromium", 2000))))
    # auto leaves less than one more slot would take: a blob, and its chunk's 2 MiB rounding
    assert clean.line(L.FREE).bytes < clean.largest_blob + 2 * MIB
    assert dirty.slots < clean.slots - 2000
    assert clean.cache_used - dirty.cache_used == pytest.approx((5000 + 2000 - 434) * MIB, abs=clean.largest_blob)


def test_too_full_a_card_is_refused_with_fixes():
    p, fp = qwen_plan(card(procs=((2101, "gnome-shell", 587), (4242, "old-engine", 6000))), ctx=131072)
    assert p.refused and p.slots < p.min_slots == 48 * 8
    assert any("close pid 4242 (old-engine) holding 6000 MiB" in f for f in p.fixes)
    assert any(f.startswith("--ctx ") for f in p.fixes)


def test_an_explicit_cache_that_does_not_fit_is_a_refusal_not_a_crash():
    p, _ = qwen_plan(expert_cache="5000")
    assert p.refused and "--expert-cache 5000 needs" in p.serve_message
    assert any(f.startswith("--expert-cache ") for f in p.fixes)


def test_a_small_reserve_is_low_and_turns_speculation_off_with_the_reason():
    p, _ = qwen_plan(vram_reserve_mib=100, spec="lookup", spec_window=8)
    assert p.serve_status == "LOW" and "a reserve of" in p.serve_message
    assert not p.spec_enabled and "MiB short" in p.spec_reason and "fits them" in p.spec_reason
    ok, _ = qwen_plan(spec="lookup", spec_window=8)
    assert ok.spec_enabled and ok.line(L.RESERVE).parts[1].bytes > 0


def test_speed_tier_uses_a_512_mib_reserve():
    p, _ = qwen_plan(tier="speed")
    assert p.reserve.total == 512 * MIB and p.reserve.recommended > 512 * MIB


@pytest.mark.parametrize("family", FAMILIES)
def test_dense_shapes_from_a_config_match_what_the_pack_holds(family, packs):
    header = read_header(packs(family))
    model = ModelConfig.from_hf(header["model_config"])
    assert dense_shapes(model) == {n: tuple(t["shape"]) for n, t in header["dense"]["tensors"].items()
                                   if n != "model.embed_tokens.weight"}
    assert from_config(model, "fp32", "fp32").blob_sizes == from_pack_header(header, "fp32").blob_sizes


def test_plan_from_a_config_json_without_weights(tmp_path):
    card_file = tmp_path / "card.json"
    card_file.write_text(json.dumps({"name": "RTX 4070 (simulated)", "total_mib": 12282,
                                     "processes": [{"pid": 2101, "name": "gnome-shell", "used_mib": 2367}]}))
    r = subprocess.run([sys.executable, "-m", "moefit", "plan", "--model-config", str(CONFIGS / "qwen3-30b-a3b.json"),
                        "--quant", "int4", "--ctx", "65536", "--kv-dtype", "int8", "--device", f"sim:{card_file}",
                        "--compute-dtype", "bf16", "--json"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) >= {"device", "ledger", "expert_cache", "serve_check", "speculative"}
    assert out["expert_cache"]["total_experts"] == 48 * 128 and out["expert_cache"]["slots"] > 384
    assert out["serve_check"]["status"] == "OK" and out["ledger"][3]["parts"][0]["name"] == "prompt path"
    r = subprocess.run([sys.executable, "-m", "moefit", "plan", "--model-config", str(CONFIGS / "qwen3-30b-a3b.json"),
                        "--ctx", "131072", "--kv-dtype", "bf16", "--device", f"sim:{card_file}",
                        "--compute-dtype", "bf16", "--kv-resident", "all"],
                       capture_output=True, text=True)
    assert r.returncode == 3 and "REFUSED" in r.stdout and "--kv-dtype int8 saves" in r.stdout
    assert "--kv-resident auto streams" in r.stdout


def test_the_seeds_131k_configuration_plans_with_kv_streaming():
    """The seed's own command, refused before KV streaming: Qwen3-30B-A3B int4 at 131K on a 4070."""
    r = subprocess.run([sys.executable, "-m", "moefit", "plan", "--model-config", str(CONFIGS / "qwen3-30b-a3b.json"),
                        "--quant", "int4", "--ctx", "131072", "--kv-dtype", "int8", "--compute-dtype", "bf16",
                        "--device", "sim:docs/rtx4070.json", "--json"], capture_output=True, text=True,
                       cwd=Path(__file__).parents[1])
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    resident = out["kv_streaming"]["resident_tokens"]
    assert out["serve_check"]["status"] == "OK" and "KV streaming" in out["serve_check"]["message"]
    assert 0 < resident < 131072 and resident % 1024 == 0
    assert out["expert_cache"]["slots"] >= out["expert_cache"]["min_slots"] == 48 * 8
    assert out["kv_streaming"]["host_bytes"] == 131072 * 48 * 2 * 4 * (128 + 4)
    text = subprocess.run([sys.executable, "-m", "moefit", "plan", "--model-config", str(CONFIGS / "qwen3-30b-a3b.json"),
                           "--quant", "int4", "--ctx", "131072", "--kv-dtype", "int8", "--compute-dtype", "bf16",
                           "--device", "sim:docs/rtx4070.json"], capture_output=True, text=True,
                          cwd=Path(__file__).parents[1]).stdout
    assert "host memory: 6,336 MiB" in text and f"last {resident} tokens (KV streaming)" in text


def test_kv_streaming_window_leaves_the_cache_its_minimum_and_a_fixed_window_is_kept():
    p, fp = qwen_plan(ctx=131072, kv_dtype="bf16", kv_resident="auto")
    assert p.kv_resident is not None and p.slots >= p.min_slots and not p.refused
    bigger, _ = qwen_plan(ctx=131072, kv_dtype="bf16", kv_resident=str(p.kv_resident + 1024))
    assert bigger.refused                                              # the window auto chose was the largest
    small, _ = qwen_plan(ctx=131072, kv_dtype="bf16", kv_resident="8192")
    assert small.kv_resident == 8192 and small.slots > p.slots
    assert small.line(L.KV).bytes == fp.state_bytes(131072, "bf16", 512, 8192)
    whole, _ = qwen_plan(ctx=8192, kv_dtype="bf16", kv_resident="auto")
    assert whole.kv_resident is None and whole.host_state_bytes == 0


def test_kv_streaming_refuses_when_host_memory_is_short():
    model = ModelConfig.from_hf(QWEN)
    fp = from_config(model, "int4", "bf16")
    cfg = ServeConfig(device="sim:x", ctx=131072, kv_dtype="bf16")
    order = Profile.empty(model.num_layers, model.num_experts).hottest_first(list(fp.blob_sizes))
    p = plan(fp, cfg, card(), order, host_free=2 << 30)
    assert p.kv_resident is not None
    assert p.refused and "host memory" in p.serve_message and any("fits in RAM" in f for f in p.fixes)


def test_plan_on_a_model_type_moefit_does_not_run_is_one_line(tmp_path):
    import subprocess
    import sys
    cfg = tmp_path / "config.json"
    cfg.write_text('{"model_type": "llama4", "hidden_size": 8}')
    r = subprocess.run([sys.executable, "-m", "moefit", "plan", "--model-config", str(cfg), "--quant", "int4",
                        "--device", "sim:docs/rtx4070.json"], capture_output=True, text=True)
    assert r.returncode == 1 and "model_type 'llama4' is not supported" in r.stderr and "Traceback" not in r.stderr

"""Family declarations (moefit/families): every published config plans, the state each
layer keeps is what its architecture keeps, and each weight-name table is transformers' own."""

import json
import re
from pathlib import Path

import pytest

from moefit.config import ModelConfig, ServeConfig
from moefit.errors import PackError
from moefit.experts.profile import Profile
from moefit.families.state import AttentionKV, LatentKV, RecurrentState, row_bytes
from moefit.memory.footprint import from_config
from moefit.memory.planner import plan
from moefit.pack.convert import convert

from test_planner import card

CONFIGS = Path(__file__).parents[1] / "configs"
PUBLISHED = sorted(p.name for p in CONFIGS.glob("*.json"))


def published(name: str) -> ModelConfig:
    return ModelConfig.from_hf_file(CONFIGS / name)


@pytest.mark.parametrize("name", PUBLISHED)
def test_every_published_config_plans_on_a_12_gb_card(name):
    m = published(name)
    fp = from_config(m, "int4", "bf16")
    cfg = ServeConfig(device="sim:x", ctx=32768, kv_dtype="int8")
    p = plan(fp, cfg, card(), Profile.empty(m.num_layers, m.num_experts).hottest_first(list(fp.blob_sizes)))
    assert sum(x.bytes for x in p.lines) == p.device.total_bytes
    assert p.line("sequence state").bytes == fp.state_bytes(32768, "int8", cfg.prefill_chunk, p.kv_resident) > 0
    assert p.host_state_bytes == fp.host_state_bytes(32768, "int8", p.kv_resident)
    assert len(m.layer_states()) == m.num_layers


def test_state_per_token_is_what_each_architecture_keeps():
    qwen = from_config(published("qwen3-30b-a3b.json"), "int4", "bf16")
    assert qwen.kv_bytes_per_token("int8") == 48 * 2 * 4 * (128 + 4)               # k and v, a scale per row
    assert qwen.kv_bytes_per_token("q4") == 48 * 2 * 4 * (64 + 2 * 4)               # 4-bit + a fp16 scale per 32
    assert qwen.kv_bytes_per_token("k8v4") == 48 * 4 * ((128 + 4) + (64 + 8))
    ds = from_config(published("deepseek-v3.json"), "int4", "bf16")
    assert ds.kv_bytes_per_token("bf16") == 61 * (512 + 64) * 2                    # MLA: latent + rope key
    assert ds.rope_bytes(131072) == 64 // 2 * 4                                # inverse frequencies only
    glm = published("glm-4.7-flash.json")                                      # DeepSeek-V3's block, smaller
    assert glm.moe_layers == tuple(range(1, 47)) and glm.head_dim == 192 + 64
    assert from_config(glm, "int4", "bf16").kv_bytes_per_token("bf16") == 47 * (512 + 64) * 2


def test_hybrid_layers_keep_constant_state_and_only_full_attention_grows():
    m = published("qwen3.6-35b-a3b.json")
    states = m.layer_states()
    full = [i for i, s in enumerate(states) if isinstance(s, AttentionKV)]
    assert full == [3, 7, 11, 15, 19, 23, 27, 31, 35, 39]
    deltanet = states[0]
    assert isinstance(deltanet, RecurrentState)
    assert deltanet.constant_bytes(2) == 2 * (4 * 32 * 128 * 128 + 2 * 8192 * 3)        # state + conv, and a snapshot
    fp = from_config(m, "int4", "bf16")
    assert fp.kv_bytes_per_token("bf16") == 10 * 2 * 2 * 256 * 2
    grow = fp.state_bytes(65536, "bf16", 512) - fp.state_bytes(32768, "bf16", 512)
    assert grow == 32768 * fp.kv_bytes_per_token("bf16")


def test_sliding_layers_hold_a_window_and_a_chunk():
    m = published("gpt-oss-20b.json")
    states = m.layer_states()
    assert [s.window for s in states[:2]] == [128, None]
    assert states[0].tokens_held(131072, 512) == 128 + 512 and states[1].tokens_held(131072, 512) == 131072


def test_row_bytes_of_each_kv_dtype():
    assert [row_bytes(128, d) for d in ("fp32", "bf16", "int8", "q4")] == [512, 256, 132, 72]
    assert LatentKV(512, 64).bytes_per_token("k8v4") == (64 + 4) + (256 + 32)


def _tiny(name: str):
    """The published config scaled down, as transformers builds it."""
    from transformers import AutoConfig
    cfg = json.loads((CONFIGS / name).read_text())
    t = dict(cfg.get("text_config", cfg))
    t.update(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             moe_intermediate_size=32, intermediate_size=96, vocab_size=128, shared_expert_intermediate_size=32,
             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
             kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
             first_k_dense_replace=1, n_routed_experts=8, num_experts=8, num_local_experts=8, num_experts_per_tok=2,
             n_group=2, topk_group=1, layer_types=None, pad_token_id=None, bos_token_id=0, eos_token_id=1)
    model_type = t.pop("model_type")
    for k in ("quantization_config", "architectures", "auto_map"):
        t.pop(k, None)
    return AutoConfig.for_model(model_type, **t)


@pytest.mark.parametrize("name", PUBLISHED)
def test_weight_name_table_is_transformers_own(name):
    from transformers import AutoModelForCausalLM
    hf_cfg = _tiny(name)
    expert_matrix = re.compile(r"experts\.(gate_up_proj|down_proj)$|experts\.\d+\.")     # in blobs, not dense
    hf = {k: tuple(v.shape) for k, v in AutoModelForCausalLM.from_config(hf_cfg).state_dict().items()
          if not expert_matrix.search(k)}
    m = ModelConfig.from_hf(hf_cfg.to_dict())
    ours = m.spec.dense_shapes(m)
    hf = {k.replace("block_sparse_moe.", "mlp."): v for k, v in hf.items()}       # Mixtral's MoE module name
    assert ours == hf


def test_a_family_moefit_only_plans_is_refused_by_pack_with_the_way_out(tmp_path, monkeypatch):
    """Every family declared today runs; a declaration may come before its forward pass."""
    from moefit.families import gpt_oss
    monkeypatch.setattr(gpt_oss, "RUNS", False)
    (tmp_path / "config.json").write_text((CONFIGS / "gpt-oss-20b.json").read_text())
    with pytest.raises(PackError, match="plans gpt_oss .* does not run it yet"):
        convert(tmp_path, tmp_path / "pack", "int4", 32)

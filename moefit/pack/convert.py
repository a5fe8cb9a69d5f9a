"""HF checkpoint directory -> native pack, streaming one tensor (or one expert) at a time.

Accepted expert spellings (per-expert keys and fused tensors):
    model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight         Qwen3-MoE, OLMoE
    model.layers.L.block_sparse_moe.experts.E.{w1,w3,w2}.weight     Mixtral (gate, up, down)
    model.layers.L.mlp.experts.gate_up_proj   [E, 2I, H]            fused (transformers 5)
    model.layers.L.mlp.experts.down_proj      [E, H, I]
Dense names are kept as the checkpoint spells them, except Mixtral's router
`block_sparse_moe.gate` which becomes `mlp.gate` like the other families.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
import shutil
import sys
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from moefit import __version__
from moefit.config import ModelConfig
from moefit.families import RUNNABLE
from moefit.errors import MoefitError, PackError
from moefit.pack import format as fmt
from moefit.pack.layout import FLOAT_QUANTS, RECIPES, check_group, expert_layout, layer_quants, matrix_quants
from moefit.pack.quant import DTYPE_NAMES, FP4_VALUES, TORCH_DTYPES, quantize

EXPERT_KEY = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                        r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
FUSED_KEY = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(gate_up_proj|down_proj)"
                       r"(?:\.weight)?$")
# Not part of the text model moefit runs: a multimodal checkpoint's vision tower.
SKIPPED_PREFIXES = ("model.visual.",)
# An MTP layer's copies of the model's embedding and output head (DeepSeek-V3 section 2.2: shared
# with the main model); the pack keeps one of each.
MTP_SHARED = re.compile(r"model\.layers\.\d+\.(?:embed_tokens|shared_head\.head)\.weight$")
QWEN_MTP_LAYER = re.compile(r"^(?:model\.)?mtp\.layers\.(\d+)\.")
FP8_SCALE = ".weight_scale_inv"
MXFP4_KEY = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)_(blocks|scales)$")
ROLE = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json", "generation_config.json")


KEEP = "keep"               # a GGUF file's default: its experts' blocks as they are


def convert(hf_dir, out, recipe: str | None = None, group_size: int = 32, progress: bool = True) -> dict:
    """Write a pack from an HF checkpoint directory or a GGUF file (recipe None: bf16 for a
    checkpoint, the file's own blocks for a GGUF file); returns the header.

    Usage: convert("Qwen3-30B-A3B/", "qwen3.pack", recipe="int4")
    """
    hf_dir, out = Path(hf_dir), Path(out)
    if hf_dir.suffix == ".gguf":
        return _convert_gguf(hf_dir, out, recipe or KEEP, group_size, progress)
    recipe = recipe or "bf16"
    raw_cfg = _read_config(hf_dir)
    block = (raw_cfg.get("quantization_config") or {}).get("weight_block_size") or (128, 128)
    tensors = _TensorSource(hf_dir, tuple(block), ModelConfig.from_hf(raw_cfg).num_layers)
    tensors.transposed_interleaved = raw_cfg.get("model_type") == "gpt_oss"
    return write_pack(tensors, raw_cfg, out, recipe, group_size, lambda dest: _copy_tokenizer(hf_dir, dest),
                      progress, hf_dir.name)


def _convert_gguf(path: Path, out: Path, recipe: str, group_size: int, progress: bool) -> dict:
    """A GGUF file, dequantised tensor by tensor and packed in `recipe` (pack/gguf_source.py)."""
    from moefit.pack.gguf_source import GGUFSource
    if not path.is_file():
        raise PackError(f"{path}: no such GGUF file")
    source = GGUFSource(path)
    quants = None
    if recipe == KEEP:                             # the file's own blocks, or an error naming what cannot be kept
        quants = source.kept_quants(list(ModelConfig.from_hf(source.hf_config()).moe_layers))
        group_size = 32
    return write_pack(source, source.hf_config(), out, recipe, group_size,
                      lambda dest: source.write_tokenizer(dest / fmt.TOKENIZER_DIR), progress, path.name, quants)


def write_pack(tensors, raw_cfg: dict, out: Path, recipe: str, group_size: int, write_tokenizer,
               progress: bool = False, name: str = "model", quants: dict[int, str] | None = None) -> dict:
    """Write a pack from any tensor source (a checkpoint, or random weights for benchmarks);
    `quants` (layer -> quant) overrides the recipe's choice (a GGUF file's kept blocks)."""
    if recipe not in RECIPES and quants is None:
        raise PackError(f"unknown quantization {recipe!r} (choose from {', '.join(RECIPES)})")
    model = ModelConfig.from_hf(raw_cfg)
    quants = quants or layer_quants(recipe, list(model.moe_layers))
    mtp = getattr(tensors, "mtp_layers", lambda: 0)()
    quants = quants | {model.num_layers + j: quants[model.moe_layers[-1]] for j in range(mtp)}  # as the last layer
    if any(q == "int4" for q in quants.values()):
        _checked(check_group, group_size, model.hidden_size, model.expert_size)
    writer = fmt.PackWriter(out)
    dense_dtype = recipe if recipe in FLOAT_QUANTS else tensors.float_dtype()
    bar = tqdm(total=len(tensors.dense_keys) + len(quants) * model.num_experts, unit="tensor",
               desc=f"packing {name}", disable=not progress, file=sys.stderr)
    _write_dense(tensors, writer, dense_dtype, bar)
    layouts = _write_experts(tensors, writer, model, quants, group_size, bar)
    bar.close()
    write_tokenizer(out)
    return writer.finish({
        "moefit_version": __version__, "family": model.family, "model_config": raw_cfg,
        "quant": {"recipe": recipe, "group_size": group_size, "dense_dtype": dense_dtype,
                  "layers": {str(k): v for k, v in quants.items()}},
        "experts_layouts": {q: fmt.layout_json(p) for q, p in layouts.items()},
        "tokenizer": {"files": sorted(p.name for p in (out / fmt.TOKENIZER_DIR).iterdir())},
        "draft": None,
        "mtp": {"layers": mtp, "style": model.mtp_style} if mtp else None,
    })


def _checked(fn, *args):
    try:
        fn(*args)
    except ValueError as e:
        raise PackError(str(e)) from None


def _read_config(hf_dir: Path) -> dict:
    f = hf_dir / "config.json"
    if not f.exists():
        raise PackError(f"{f}: missing (is {hf_dir} a Hugging Face checkpoint directory?)")
    try:
        model = ModelConfig.from_hf_file(f)
    except MoefitError as e:
        raise PackError(str(e)) from None
    if not model.spec.RUNS:
        raise PackError(f"{f}: moefit plans {model.family} (`moefit plan --model-config {f}`) but does not "
                        f"run it yet; it runs {', '.join(RUNNABLE)}")
    return json.loads(f.read_text())


class _TensorSource:
    """Every tensor of a (possibly sharded) safetensors checkpoint, read lazily."""

    OPEN_SHARDS = 2          # shards mapped at once: peak RSS stays near the largest shards, not the model

    def __init__(self, hf_dir: Path, fp8_block: tuple[int, int] = (128, 128), layers: int = 0):
        self.hf_dir, self.fp8_block, self.layers = hf_dir, fp8_block, layers
        self.transposed_interleaved = False   # gpt-oss: experts [N, E, 2I] with gate / up columns interleaved
        self.file_of = _weight_map(hf_dir)
        self._open: OrderedDict[str, object] = OrderedDict()
        self.per_expert: dict[tuple[int, int, str], str] = {}
        self.fused: dict[tuple[int, str], str] = {}
        self.mxfp4: dict[tuple[int, str, str], str] = {}                  # gpt-oss: (layer, matrix, blocks|scales)
        self.dense_keys: list[str] = []
        for key in self.file_of:
            self._classify(key)
        self.dense_keys.sort(key=lambda k: self.file_of[k])            # one shard after another

    def _handle(self, key: str):
        f = self.file_of[key]
        if f in self._open:
            self._open.move_to_end(f)
        else:
            self._open[f] = open_shard(self.hf_dir / f)
            while len(self._open) > self.OPEN_SHARDS:
                self._open.popitem(last=False)                           # unmaps that shard
        return self._open[f]

    def _classify(self, key: str) -> None:
        if key.startswith(SKIPPED_PREFIXES) or key.endswith(FP8_SCALE) or MTP_SHARED.match(key):
            return
        name = canonical_dense_name(key, self.layers)
        if m := MXFP4_KEY.match(name):
            self.mxfp4[(int(m[1]), m[2], m[3])] = key
        elif m := EXPERT_KEY.match(name):
            self.per_expert[(int(m[1]), int(m[2]), ROLE[m[3]])] = key
        elif m := FUSED_KEY.match(name):
            self.fused[(int(m[1]), m[2])] = key
        else:
            self.dense_keys.append(key)

    def get(self, key: str) -> torch.Tensor:
        t = self._handle(key).get_tensor(key).clone()                # a copy: the shard may be unmapped
        return self._dequantised(key, t) if t.dtype == torch.float8_e4m3fn else t

    def _dequantised(self, key: str, t: torch.Tensor) -> torch.Tensor:
        """An FP8 block-quantised weight (DeepSeek-V3's checkpoints: e4m3 codes and one fp32
        `weight_scale_inv` per block of quantization_config's weight_block_size, [128, 128]) in bf16,
        exactly as the codes times the scales."""
        scale_key = key + FP8_SCALE[len(".weight"):] if key.endswith(".weight") else None
        if scale_key not in self.file_of:
            raise PackError(f"{key}: FP8 weight without its {FP8_SCALE} (a block-quantised checkpoint is expected)")
        scale = self._handle(scale_key).get_tensor(scale_key).float()
        rows, cols = self.fp8_block
        full = scale.repeat_interleave(rows, 0)[:t.shape[0]].repeat_interleave(cols, 1)[:, :t.shape[1]]
        return (t.float() * full).to(torch.bfloat16)

    def mtp_layers(self) -> int:
        """MTP layers whose experts the checkpoint has (past the model's last layer)."""
        found = {k[0] for k in self.per_expert} | {k[0] for k in self.fused}
        return len({layer for layer in found if layer >= self.layers}) if self.layers else 0

    def float_dtype(self) -> str:
        return DTYPE_NAMES.get(self.get(self.dense_keys[0]).dtype, "fp32")

    def expert(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [2I, H], down [H, I]) of one expert."""
        if (layer, "gate_up_proj", "blocks") in self.mxfp4:
            gate_up, down = (self._mxfp4(layer, name, expert) for name in ("gate_up_proj", "down_proj"))
            return torch.cat([gate_up[0::2], gate_up[1::2]]), down        # gate / up rows interleaved
        if (layer, "gate_up_proj") in self.fused:
            gate_up_key, down_key = self.fused[(layer, "gate_up_proj")], self.fused[(layer, "down_proj")]
            gate_up = self._handle(gate_up_key).get_slice(gate_up_key)[expert].clone()
            down = self._handle(down_key).get_slice(down_key)[expert].clone()
            if self.transposed_interleaved:
                gate_up, down = gate_up.T, down.T
                gate_up = torch.cat([gate_up[0::2], gate_up[1::2]])             # [gate rows; up rows]
            return gate_up.contiguous(), down.contiguous()
        try:
            gate, up, down = (self.get(self.per_expert[(layer, expert, r)]) for r in ("gate", "up", "down"))
        except KeyError:
            raise PackError(f"checkpoint has no weights for (layer {layer}, expert {expert})") from None
        return torch.cat([gate, up], dim=0), down


    def _mxfp4(self, layer: int, name: str, expert: int) -> torch.Tensor:
        """One expert's matrix [rows, cols] from MXFP4 (gpt-oss): per row, blocks of 32 values as
        16 bytes of e2m1 codes (low nibble first) and one e8m0 scale, value = fp4 x 2^(scale - 127)."""
        b_key, s_key = self.mxfp4[(layer, name, "blocks")], self.mxfp4[(layer, name, "scales")]
        blocks = self._handle(b_key).get_slice(b_key)[expert]                       # [R, G, 16] uint8
        scales = self._handle(s_key).get_slice(s_key)[expert].to(torch.int32) - 127  # [R, G]
        lut = torch.tensor(FP4_VALUES)
        values = torch.stack((lut[(blocks & 15).long()], lut[(blocks >> 4).long()]), dim=-1).flatten(-2)
        return torch.ldexp(values, scales[..., None].float()).flatten(1)             # [R, G * 32]


def _weight_map(hf_dir: Path) -> dict[str, str]:
    index = hf_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            return json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise PackError(f"{index}: not a safetensors index ({e})") from None
    files = sorted(p.name for p in hf_dir.glob("*.safetensors"))
    if not files:
        raise PackError(f"{hf_dir}: no safetensors weights found")
    out = {}
    for f in files:
        out.update({k: f for k in open_shard(hf_dir / f).keys()})
    return out


def open_shard(path: Path):
    """A safetensors file opened lazily; PackError naming it when it is truncated or not one."""
    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as e:
        raise PackError(f"{path}: not a complete safetensors file ({e}); download it again") from None


def canonical_dense_name(key: str, layers: int = 0) -> str:
    """One name per weight: Mixtral's router under mlp.gate, a multimodal checkpoint's text
    model (Qwen3.5 / 3.6: model.language_model.*) under model.*, and Qwen's MTP layer j
    (mtp.layers.j.*) as the layer after the last, model.layers.{layers + j}.* (DeepSeek's naming)."""
    key = key.replace(".block_sparse_moe.gate.", ".mlp.gate.")
    if m := QWEN_MTP_LAYER.match(key):
        return f"model.layers.{layers + int(m[1])}." + key[m.end():]
    if key.startswith("model.mtp."):
        key = key[len("model."):]
    return "model." + key[len("model.language_model."):] if key.startswith("model.language_model.") else key


def _write_dense(tensors: _TensorSource, writer: fmt.PackWriter, dtype: str, bar) -> None:
    for key in tensors.dense_keys:
        t = tensors.get(key).to(TORCH_DTYPES[dtype]).contiguous()
        writer.add_dense(canonical_dense_name(key, getattr(tensors, "layers", 0)), _bytes(t), dtype, tuple(t.shape))
        bar.update()


def _write_experts(tensors, writer, model: ModelConfig, quants: dict[int, str], group: int, bar) -> dict:
    layouts = {q: expert_layout(model.hidden_size, model.expert_size, q, group) for q in set(quants.values())}
    for layer, quant in quants.items():
        for expert in range(model.num_experts):
            data = getattr(tensors, "expert_parts", lambda *_: None)(layer, expert, quant, group)
            if data is None:                                # anything but blocks moefit keeps as they are
                gate_up, down = tensors.expert(layer, expert)
                q_gate_up, q_down = matrix_quants(quant)
                data = quantize(gate_up, q_gate_up, group) + quantize(down, q_down, group)
            writer.add_blob(layer, expert, quant, [(p, _bytes(t)) for p, t in zip(layouts[quant], data)])
            bar.update()
    return layouts


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _copy_tokenizer(hf_dir: Path, out: Path) -> None:
    dest = out / fmt.TOKENIZER_DIR
    dest.mkdir(parents=True, exist_ok=True)
    if not (hf_dir / "tokenizer.json").exists():
        raise PackError(f"{hf_dir / 'tokenizer.json'}: missing (moefit needs the fast tokenizer file)")
    for name in TOKENIZER_FILES:
        if (hf_dir / name).exists():
            shutil.copyfile(hf_dir / name, dest / name)

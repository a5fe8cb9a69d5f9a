"""A GGUF file (llama.cpp's format) as a tensor source for the pack writer: the metadata becomes
the HF config.json moefit reads, `tokenizer.ggml.*` a tokenizer.json, and each tensor is read
from the file's mmap and dequantised with `gguf.quants` when the writer asks for it (one
expert's slice of a [N, rows, cols] tensor at a time), so RSS stays near one tensor.

Experts keep their blocks (KEEP): Q4_0 is moefit's int4 layout (4-bit codes offset by 8, one
fp16 scale per 32) up to the order of the nibbles, so the codes are reshuffled, not
re-quantised; Q8_0 is moefit's q8_0 as it is; Q4_K, Q5_K, Q6_K, IQ4_XS and MXFP4 stay the file's
blocks (the host kernel and pack/kblocks.py read them; MXFP4 converts to q8_0 exactly when that
recipe is asked for); a layer may mix two (a Q4_K_M file's Q4_K gate and up, Q6_K down). The
pack holds llama.cpp's exact weights. With --requant (or --quant) every expert is dequantised to
float and packed in that recipe. Architectures: pack/gguf_archs.py, one entry per llama.cpp
architecture; others are named in the error.

Usage: source = GGUFSource("model.gguf"); source.hf_config(); source.write_tokenizer(out)
"""

from __future__ import annotations

import json
import re
import struct
import warnings
from pathlib import Path

import numpy as np
import torch

from moefit.errors import PackError
from moefit.pack.gguf_archs import ARCHS, TOP, common_config
from moefit.pack.layout import GGUF_BLOCKS, matrix_quants
from moefit.pack.quant import FP4_VALUES

LAYER = re.compile(r"blk\.(\d+)\.(.+)$")
EXPERTS = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")
# Each pre-tokenizer llama.cpp names (tokenizer.ggml.pre) as its tokenizer.json gives it: the regex
# splits, applied in turn, and whether a word in the vocabulary is taken whole before any merge
PRE_TOKENIZERS = {
    "gpt-2": ([r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"], False),
    "qwen2": ([r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+"], False),
    "qwen35": ([r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+"], False),                # Qwen3.5 / 3.6: letters keep their marks
    "glm4": ([r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
              r"|\s+(?!\S)|\s+"], True),
    "deepseek-v3": ([r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
                     "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
                     "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"], False),
}
PRE_TOKENIZERS["glm5"] = PRE_TOKENIZERS["glm4"]                 # llama.cpp reads both as ChatGLM-4's
# gpt-oss (o200k): words split where the case changes, a contraction kept with its word, digits in threes
PRE_TOKENIZERS["gpt-4o"] = ([
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"], False)


SPLIT = re.compile(r"^(.*)-(\d{5})-of-(\d{5})\.gguf$")


def split_files(path: Path) -> list[Path]:
    """A model split by llama.cpp's gguf-split (NAME-00001-of-00003.gguf ...): every part, in
    order, given any one of them; a single file: itself."""
    m = SPLIT.match(path.name)
    if not m:
        return [path]
    parts = [path.with_name(f"{m[1]}-{i:05d}-of-{m[3]}.gguf") for i in range(1, int(m[3]) + 1)]
    missing = [p.name for p in parts if not p.exists()]
    if missing:
        raise PackError(f"{path}: split GGUF parts missing: {', '.join(missing)}")
    return parts


class GGUFSource:
    def __init__(self, path: Path):
        from moefit.pack.gguf_file import GGUFFile
        self.path = Path(path)
        self.files = split_files(self.path)
        try:
            readers = [GGUFFile(p) for p in self.files]
        except (ValueError, OSError, struct.error, UnicodeDecodeError) as e:
            raise PackError(f"{self.path}: not a readable GGUF file ({e})") from None
        self.metadata = readers[0].meta                               # the metadata is in the first part
        self.arch = self.meta("general.architecture")
        if self.arch not in ARCHS:
            raise PackError(f"{self.path}: GGUF architecture {self.arch!r} is not supported yet "
                            f"(supported: {', '.join(ARCHS)})")
        self.spec = ARCHS[self.arch]
        self.tensors = {t.name: t for r in readers for t in r.tensors}
        self.layers = self.spec.layers(self._m)
        self.by_hf = self._hf_names()
        self.dense_keys = list(self.by_hf)                             # HF names, as the pack stores them
        self._config = None

    # -- metadata ---------------------------------------------------------------
    def meta(self, key: str, default=None):
        return self.metadata.get(key, default)

    def _m(self, key: str, default=None):
        """The architecture's key (without its "ARCH." prefix), or a tokenizer. / general. key as is."""
        return self.meta(key if key.startswith(("tokenizer.", "general.")) else f"{self.arch}.{key}", default)

    def hf_config(self) -> dict:
        if self._config is None:
            self._config = self._hf_config()
        return self._config

    def _hf_config(self) -> dict:
        cfg = {"model_type": self.spec.model_type, "architectures": [self.spec.architecture],
               "vocab_size": len(self.meta("tokenizer.ggml.tokens")), "num_hidden_layers": self.layers,
               **common_config(self._m), **self.spec.config(self._m)}
        # what every family's attention has is what the file holds, not what the metadata says
        cfg["attention_bias"] = any(n.endswith(".attn_q.bias") for n in self.tensors)
        cfg["use_qk_norm"] = any(n.endswith(".attn_q_norm.weight") for n in self.tensors)
        return {**cfg, "tie_word_embeddings": "output.weight" not in self.tensors,
                "bos_token_id": self.meta("tokenizer.ggml.bos_token_id"),
                "eos_token_id": self.meta("tokenizer.ggml.eos_token_id"),
                "moefit_source": {"gguf": self.path.name, "files": [f.name for f in self.files],
                                  "sha256": self.sha256(), "types": self.type_summary(),
                                  "pre_tokenizer": self.meta("tokenizer.ggml.pre", "gpt-2"),
                                  "tensor_types": {n: t.tensor_type.name for n, t in self.tensors.items()}}}

    def sha256(self) -> str:
        """Of the file (every part, in order), read in 16 MiB pieces."""
        import hashlib
        h = hashlib.sha256()
        for f in self.files:
            with open(f, "rb") as fh:
                while piece := fh.read(16 << 20):
                    h.update(piece)
        return h.hexdigest()

    def type_summary(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self.tensors.values():
            out[t.tensor_type.name] = out.get(t.tensor_type.name, 0) + 1
        return out

    # -- tensors ----------------------------------------------------------------
    def _hf_names(self) -> dict[str, tuple[str, ...]]:
        """HF name -> the GGUF tensor(s) it is made of; MTP layers past the model's own are skipped."""
        out, joined = {}, {g for names, _ in self.spec.joins.values() for g in names}
        self.split_of: dict[str, tuple[str, int]] = {}          # HF name -> (GGUF tensor, which part)
        for name in self.tensors:
            m = LAYER.match(name)
            if name.endswith(EXPERTS) or (m and (int(m[1]) >= self.layers or m[2] in joined)):
                continue
            if m and m[2] in self.spec.splits:
                for j, hf in enumerate(self.spec.splits[m[2]][0]):
                    out[f"model.layers.{m[1]}.{hf}"] = (name,)
                    self.split_of[f"model.layers.{m[1]}.{hf}"] = (m[2], j)
                continue
            out[self.hf_name(name)] = (name,)
        for layer in range(self.layers):
            for hf, (names, _) in self.spec.joins.items():
                parts = tuple(f"blk.{layer}.{n}" for n in names)
                if all(p in self.tensors for p in parts):
                    out[f"model.layers.{layer}.{hf}"] = parts
        return out

    def hf_name(self, name: str) -> str:
        if name in TOP:
            return TOP[name]
        m = LAYER.match(name)
        if not m or m[2] not in self.spec.names:
            raise PackError(f"{self.path}: tensor {name} has no place in a {self.arch} model")
        return f"model.layers.{m[1]}.{self.spec.names[m[2]]}"

    def get(self, hf_name: str) -> torch.Tensor:
        parts = [self.tensors[n] for n in self.by_hf[hf_name]]
        tensors = [_dequantised(t.data, t.tensor_type, _shape(t)) for t in parts]
        if len(tensors) > 1:
            suffix = hf_name.split(".", 3)[3]
            return self.spec.joins[suffix][1](*tensors)
        t = tensors[0]
        if hf_name in self.split_of:
            gguf_suffix, j = self.split_of[hf_name]
            t = self.spec.splits[gguf_suffix][1](t, self.hf_config())[j].contiguous()
        return self.spec.fix(hf_name, t, self.hf_config()) if self.spec.fix else t

    def float_dtype(self) -> str:
        return "fp32"

    def expert(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [2I, E], down [E, I]) of one expert, dequantised from its slice of the file."""
        gate, up, down = (self._expert_slice(f"blk.{layer}.{n}", expert) for n in EXPERTS)
        return torch.cat([gate, up], dim=0), down

    def expert_parts(self, layer: int, expert: int, quant: str, group: int) -> list[torch.Tensor] | None:
        """The expert's blob parts straight from its GGUF blocks (kept_quants' choice), or None when
        they must go through float (a float type, an MXFP4 scale beyond fp16)."""
        tensors = [self.tensors.get(f"blk.{layer}.{n}") for n in EXPERTS]
        if any(t is None for t in tensors) or (group != 32 and "int4" in matrix_quants(quant)):
            return None
        gate_up, down = matrix_quants(quant)
        parts = [_kept_parts(np.asarray(t.data[expert]), t.tensor_type, want)
                 for t, want in zip(tensors, (gate_up, gate_up, down))]
        if any(p is None for p in parts):
            return None
        gate, up, down = parts
        return [torch.cat([a, b]) for a, b in zip(gate, up)] + list(down)

    def kept_quants(self, layers: list[int]) -> dict[int, str]:
        """Each MoE layer's quant that holds its experts' GGUF blocks as they are ("q4_k/q6_k": gate
        and up in Q4_K, down in Q6_K); PackError naming the tensor and its type where moefit has
        none (the way out: --requant)."""
        out = {}
        for layer in layers:
            tensors = [self.tensors[f"blk.{layer}.{n}"] for n in EXPERTS if f"blk.{layer}.{n}" in self.tensors]
            kinds = [KEEP.get(t.tensor_type.name) for t in tensors]
            odd = next((t for t, kind in zip(tensors, kinds) if kind is None), None)
            if odd is None and len(kinds) == 3 and kinds[0] != kinds[1]:
                odd = tensors[1]                                     # gate and up are one matrix
            if odd is not None:
                raise PackError(f"{self.path}: {odd.name} is {odd.tensor_type.name}: moefit keeps "
                                f"{', '.join(KEEP)} experts as they are (gate and up of one type); "
                                "re-quantise the others with --requant int4|int8|q8_0")
            gate_up, down = kinds[0], kinds[-1]
            if gate_up != down and {gate_up, down} & {"fp32", "fp16", "bf16"}:
                raise PackError(f"{self.path}: {tensors[-1].name} is {tensors[-1].tensor_type.name} and its gate "
                                f"{tensors[0].tensor_type.name}: a float matrix with a quantised one in one layer; "
                                "re-quantise with --requant int4|int8|q8_0")
            out[layer] = gate_up if gate_up == down else f"{gate_up}/{down}"
        return out

    def _expert_slice(self, name: str, expert: int) -> torch.Tensor:
        t = self.tensors.get(name)
        if t is None:
            raise PackError(f"{self.path}: tensor {name} is missing")
        shape = _shape(t)                                               # [N, rows, cols]
        return _dequantised(t.data[expert], t.tensor_type, shape[1:])

    # -- tokenizer --------------------------------------------------------------
    def write_tokenizer(self, out: Path) -> None:
        """tokenizer.json (byte-level BPE from tokenizer.ggml.tokens / merges) and
        tokenizer_config.json (special tokens, the chat template)."""
        from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
        if self.meta("tokenizer.ggml.model") != "gpt2":
            raise PackError(f"{self.path}: tokenizer {self.meta('tokenizer.ggml.model')!r} is not supported yet "
                            "(byte-level BPE, 'gpt2', is)")
        tokens, types = self.meta("tokenizer.ggml.tokens"), self.meta("tokenizer.ggml.token_type", [])
        merges = [tuple(m.split(" ", 1)) for m in self.meta("tokenizer.ggml.merges", [])]
        splits, whole_words = PRE_TOKENIZERS.get(self.meta("tokenizer.ggml.pre", "gpt-2"), PRE_TOKENIZERS["gpt-2"])
        tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, ignore_merges=whole_words))
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            *(pre_tokenizers.Split(Regex(split), behavior="isolated") for split in splits),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        special = [t for t, kind in zip(tokens, types) if kind in (3, 4)]     # CONTROL, USER_DEFINED
        tok.add_special_tokens(special)
        out.mkdir(parents=True, exist_ok=True)
        tok.save(str(out / "tokenizer.json"))
        eos = self.meta("tokenizer.ggml.eos_token_id")
        cfg = {"eos_token": tokens[eos] if eos is not None else None,
               "chat_template": self.meta("tokenizer.chat_template")}
        (out / "tokenizer_config.json").write_text(json.dumps(cfg))


def _shape(t) -> tuple[int, ...]:
    """The tensor's shape in PyTorch order (GGUF lists dims innermost first)."""
    return tuple(int(d) for d in reversed(t.shape.tolist()))


# GGUF types kept as they are, and the pack layout that holds them (pack/layout.py)
KEEP = {"Q4_0": "int4", "Q8_0": "q8_0", "MXFP4": "mxfp4", "Q4_K": "q4_k", "Q5_K": "q5_k", "Q6_K": "q6_k",
        "IQ4_XS": "iq4_xs", "F32": "fp32", "F16": "fp16", "BF16": "bf16"}


def _kept_parts(raw: np.ndarray, qtype, want: str) -> tuple[torch.Tensor, ...] | None:
    """One matrix's rows of blocks [rows, bytes] as the parts of layout `want`, or None where that
    is not its kept layout (a float type, another recipe: read through float). MXFP4 also converts
    to q8_0 exactly (an exponent beyond fp16's powers of two aside)."""
    name = qtype.name
    if name == "MXFP4" and want == "q8_0":
        return _mxfp4_as_q8_0(raw)
    if KEEP.get(name) != want:
        return None
    if name == "Q4_0":
        return _q4_0_as_int4(raw)
    if name == "Q8_0":
        return _q8_0_parts(raw)
    if want in GGUF_BLOCKS:                               # the blocks as they are
        return (torch.from_numpy(np.ascontiguousarray(raw).copy()),)
    return None


def _q8_0_parts(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 blocks [rows, blocks x 34 bytes] (a fp16 scale d, then 32 int8 codes, value code x d)
    -> moefit q8_0 parts: codes [rows, cols] int8 and scales [rows, blocks] fp16, as they are."""
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(rows, -1, 34)
    scale = torch.from_numpy(np.ascontiguousarray(blocks[:, :, :2]).view(np.float16)[..., 0].copy())
    codes = torch.from_numpy(np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8).reshape(rows, -1).copy())
    return codes, scale


MXFP4_VALUES = (2 * np.array(FP4_VALUES)).astype(np.int8)             # e2m1, doubled: integers


def _mxfp4_as_q8_0(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor] | None:
    """MXFP4 blocks [rows, blocks x 17 bytes] (an e8m0 exponent e, then 16 bytes of e2m1 codes, low
    nibbles elements 0-15; value = 2^(e - 128) x doubled e2m1) -> q8_0 parts exactly: the doubled
    values as int8 codes, 2^(e - 128) as the fp16 scale. None when an exponent is beyond fp16's
    exact powers of two (2^-24 .. 2^15): those go through float."""
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(rows, -1, 17)
    e = blocks[:, :, 0].astype(np.int32)
    if e.min() < 128 - 24 or e.max() > 128 + 15:
        return None
    qs = blocks[:, :, 1:]
    nibbles = np.concatenate((qs & 15, qs >> 4), axis=-1)                              # element order
    codes = torch.from_numpy(MXFP4_VALUES[nibbles].reshape(rows, -1).copy())
    scale = torch.from_numpy(np.ldexp(np.ones_like(e, dtype=np.float32), e - 128).astype(np.float16))
    return codes, scale


def _q4_0_as_int4(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_0 blocks [rows, blocks x 18 bytes] (a fp16 scale d, then 16 bytes whose low nibbles are
    elements 0-15 and high nibbles 16-31, value (code - 8) d) -> moefit int4 parts: codes
    [rows, cols / 2] with even columns in the low nibble, scales [rows, blocks] fp16."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, 18)
    scale = torch.from_numpy(np.ascontiguousarray(blocks[:, :, :2]).view(np.float16)[..., 0].copy())
    qs = torch.from_numpy(np.ascontiguousarray(blocks[:, :, 2:]))                     # [R, B, 16]
    codes = torch.cat((qs & 15, qs >> 4), dim=-1).reshape(rows, -1)                  # element order
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8), scale


# GGUF block types the host kernel dequantises (kernels/dequant.h, over its pool): the ones a pack
# keeps as the file's blocks; bit for bit gguf.quants' numbers (tests/test_quant.py), which took
# ~half of `moefit pack`'s time on a Q4_K_M file in numpy
NATIVE_DEQUANT = {name: quant for name, quant in KEEP.items() if quant in GGUF_BLOCKS}


def _dequantised(data: np.ndarray, qtype, shape: tuple[int, ...]) -> torch.Tensor:
    from gguf import GGMLQuantizationType, quants
    if (native := _natively_dequantised(data, qtype, shape)) is not None:
        return native
    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        arr = np.asarray(data, dtype=np.float32)
    else:
        try:
            arr = quants.dequantize(np.asarray(data), qtype)
        except NotImplementedError:
            raise PackError(f"GGUF type {qtype.name} cannot be dequantised by gguf.quants") from None
    return torch.from_numpy(np.array(arr, dtype=np.float32, copy=True)).reshape(shape)


def _natively_dequantised(data: np.ndarray, qtype, shape: tuple[int, ...]) -> torch.Tensor | None:
    """A matrix of NATIVE_DEQUANT's blocks as fp32 by the host kernel; None for other types and
    shapes, or without the kernel (gguf.quants then)."""
    from moefit import kernels
    quant = NATIVE_DEQUANT.get(qtype.name)
    if quant is None or data.ndim != 2 or len(shape) != 2:
        return None
    with warnings.catch_warnings():                   # the file's read-only map: the kernel only reads it
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.from_numpy(np.ascontiguousarray(data))
    out = kernels.dequantize({"w": raw}, "w", quant)
    return out if out is not None and tuple(out.shape) == tuple(shape) else None

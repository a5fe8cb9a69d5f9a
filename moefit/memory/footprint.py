"""What a model costs on the device, from a pack header or from a bare config.json.
Pure arithmetic: `moefit plan` answers "does it fit?" before any download.

Legend: E hidden, H heads, K kv heads, D head dim, I expert size, N experts, k top-k,
V vocab, cb bytes per element of the compute dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

from moefit.config import ModelConfig
from moefit.families.common import mtp_index, rope_dim
from moefit.families.state import PROMPT_MARKS, layer_bytes
from moefit.memory.allocator import MIN_BLOCK, block_bytes
from moefit.pack.layout import DENSE_GROUP, dense_quantizable, expert_blob_sizes

COMPUTE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
RESIDENT_GROUP = 8     # at most this many resident experts multiplied at once (experts/grouped.py) ...
SCRATCH_SHARE = 100    # ... and their scratch at most 1/100 of the card (at least one expert's)
Key = tuple[int, int]


@dataclass(frozen=True)
class Footprint:
    model: ModelConfig
    compute_dtype: str
    dense_bytes: int                 # on the device, without RoPE tables (those depend on ctx)
    blob_sizes: dict[Key, int]       # every (layer, expert)
    draft_head_bytes: int = 0
    mtp_layers: int = 0              # multi-token-prediction layers (a draft source, in the reserve)
    mtp_dense_bytes: int = 0         # their device weights (their experts stay on the host)
    probe_bytes: int = 0             # the look-ahead's trained probe, with the dense weights when it looks ahead

    @property
    def cb(self) -> int:
        return COMPUTE_BYTES[self.compute_dtype]

    @property
    def largest_blob(self) -> int:
        return max(self.blob_sizes.values(), default=0)

    @property
    def min_slots(self) -> int:
        """One token's worth: every MoE layer's top-k."""
        return len(self.model.moe_layers) * self.model.top_k

    @property
    def states(self) -> list:
        """Each layer's sequence-state declaration (families/state.py)."""
        return self.model.layer_states()

    def rope_bytes(self, ctx: int) -> int:
        """RoPE's inverse frequencies (fp32, half the rotated dims); cos / sin are computed per
        forward, so this does not grow with the context."""
        return rope_dim(self.model) // 2 * 4

    @property
    def slot_table_bytes(self) -> int:
        """The device's (layer, expert) -> slot address table, int64 (experts/slot_table.py)."""
        return self.model.num_layers * self.model.num_experts * 8

    def state_bytes(self, ctx: int, kv_dtype: str, chunk: int, resident: int | None = None) -> int:
        """Device bytes of one session's sequence state: KV (or MLA latent) per token held, plus
        constant recurrent state; with `resident`, streaming layers keep that many tokens."""
        return sum(layer_bytes(s, ctx, kv_dtype, self.cb, chunk, resident) for s in self.states)

    def host_state_bytes(self, ctx: int, kv_dtype: str, resident: int | None) -> int:
        """Host bytes of one session under KV streaming: every streaming layer's whole context
        (written through, so the older part is there when the card's window moves on)."""
        if resident is None:
            return 0
        return sum(ctx * s.bytes_per_token(kv_dtype) for s in self.states if s.streams)

    def host_mark_bytes(self) -> int:
        """Host bytes of one session's recurrent states kept at the last PROMPT_MARKS prompts' ends
        (where the next turn of a chat resumes, runtime/state.py): half a layer's constant part each."""
        return PROMPT_MARKS * sum(s.constant_bytes(self.cb) // 2 for s in self.states if s.kind == "recurrent")

    def kv_bytes_per_token(self, kv_dtype: str, resident: bool = False) -> int:
        """What one more token of context costs on the card (layers whose state grows with it;
        none of a streaming layer's once a resident window is set)."""
        return sum(s.bytes_per_token(kv_dtype) for s in self.states
                   if s.window is None and not (resident and s.streams))

    def activation_bytes_per_token(self) -> int:
        """Live activations of one token through a layer (the largest layer)."""
        m = self.model
        width = (4 * m.hidden_size + (2 * m.num_heads + 2 * m.num_kv_heads) * m.head_dim
                 + m.top_k * (3 * m.expert_size + m.hidden_size))
        return width * self.cb + 4 * m.num_experts

    def prompt_path_bytes(self, chunk: int, ctx: int, kv_dtype: str, resident: int | None = None,
                          group: tuple[int, int] = (1, 1 << 62)) -> int:
        """A prefill chunk's activations, its logits row, one layer's state read back in the
        compute dtype when it is stored in another (the largest layer; within the window), and
        the scratch of multiplying resident experts (`group`: resident_group's answer)."""
        m = self.model
        dequant = 0
        if kv_dtype != self.compute_dtype:
            dequant = max((layer_bytes(s, ctx, "fp32", 1, chunk, resident) // 4 * self.cb
                           for s in self.states if s.kind != "recurrent"), default=0)
        activations = chunk * self.activation_bytes_per_token() + 4 * m.vocab_size
        return activations + dequant + self.expert_scratch_bytes(*group)

    def expert_scratch_per_weight(self) -> int:
        """Device bytes a resident expert's multiply holds per weight of the slice it multiplies
        (experts/grouped.py): int4's codes as int8, in the compute dtype and transposed (1 + 2 cb),
        the per-group partial sums of a few rows (2), or a dequantised slice in fp32 and in the
        compute dtype (4 + cb; a K-quant's codes stay one byte a weight until that fp32 copy:
        pack/kblocks.py). tests/test_grouped.py measures each kind's peak on CPU tensors."""
        return 6 + 2 * self.cb

    def resident_group(self, card_bytes: int) -> tuple[int, int]:
        """(experts multiplied at once, weights of a matrix slice) for a device step: their scratch
        within 1/SCRATCH_SHARE of the card, 1 to RESIDENT_GROUP experts, and where one expert's
        gate_up alone would exceed it, that expert in row slices (a 12 GiB card: Qwen3-30B-A3B
        3 experts whole, Mixtral-8x7B one in slices)."""
        m = self.model
        budget, whole = card_bytes // SCRATCH_SHARE, 2 * m.expert_size * m.hidden_size
        one = self.largest_blob + whole * self.expert_scratch_per_weight()
        if one <= budget:
            return min(RESIDENT_GROUP, budget // one), whole
        return 1, max(m.hidden_size, m.expert_size, (budget - self.largest_blob) // self.expert_scratch_per_weight())

    def expert_scratch_bytes(self, group: int, slice_weights: int) -> int:
        """The scratch of multiplying `group` resident experts in slices of `slice_weights`: their
        blobs stacked, and each one's slice."""
        m = self.model
        weights = min(slice_weights, 2 * m.expert_size * m.hidden_size)
        return group * (self.largest_blob + weights * self.expert_scratch_per_weight())

    def mtp_bytes(self, ctx: int, kv_dtype: str, chunk: int, resident: int | None = None, sessions: int = 1) -> int:
        """The first MTP layer as a draft source (runtime/mtp.py): its weights and its own KV over
        the context for each session (under KV streaming, its last `resident` tokens, like the
        model's layers)."""
        if not self.mtp_layers:
            return 0
        state = self.model.spec.mtp_state(self.model)
        return self.mtp_dense_bytes + sessions * layer_bytes(state, ctx, kv_dtype, self.cb, chunk, resident)

    def mtp_host_bytes(self, ctx: int, kv_dtype: str, resident: int | None) -> int:
        """Host bytes of the MTP layer's KV under KV streaming (the whole context, written through)."""
        return ctx * self.model.spec.mtp_state(self.model).bytes_per_token(kv_dtype) \
            if self.mtp_layers and resident is not None else 0

    def draft_bytes(self, mode: str, ctx: int, kv_dtype: str, chunk: int, resident: int | None = None,
                    sessions: int = 1) -> int:
        """What a draft source holds in the reserve: a trained head, the MTP layer, or nothing."""
        return {"head": self.draft_head_bytes,
                "mtp": self.mtp_bytes(ctx, kv_dtype, chunk, resident, sessions)}.get(mode, 0)

    def decode_graph_bytes(self, ctx: int, windows: list[int], chunk: int, sessions: int = 1) -> int:
        """At most what --decode-graphs' pieces pass each other (runtime/decode_graphs.py, Rows) for a
        decode step and each verify window length: the residual rows, each layer's MoE input and
        guess, the routers' output, RoPE's rows, a mask per context bucket (together under 2 ctx
        keys a token) and a window's recurrent checkpoints; and each session's ring layers' slot
        positions (8 bytes a slot). The recordings' pool is not in it: it is measured on the card
        (decode_graphs.pool_bytes) and the headroom holds it."""
        rings = sum(block_bytes(8 * held) for s in self.states if s.kind == "attention"
                    and (held := s.tokens_held(ctx, chunk)) < ctx)
        return self._graph_rows_bytes(ctx, windows) + sessions * rings

    def _graph_rows_bytes(self, ctx: int, windows: list[int]) -> int:
        m, cb = self.model, self.cb
        ranks = min(2 * m.top_k, m.num_experts)
        state = max((s.recurrent_bytes() for s in self.states if s.kind == "recurrent"), default=0)
        per_token = ((3 + m.num_layers) * m.hidden_size * cb + 8 + m.num_layers * ranks * 8
                     + len(m.moe_layers) * m.top_k * (cb + 8) + 2 * rope_dim(m) * cb + 2 * ctx)
        tensors = 8 + 2 * m.num_layers + 2 * len(m.moe_layers) + ctx.bit_length()     # each a 512-byte block at least
        return MIN_BLOCK + sum(t * per_token + (t - 1) * state + tensors * MIN_BLOCK for t in [1, *windows])

    def verify_arena_bytes(self, window: int) -> int:
        """A verify window's activations and logits, and each recurrent layer's state after every
        position but the last (runtime/state.py: checkpoints, so a rejection costs one copy)."""
        checkpoints = sum(s.recurrent_bytes() for s in self.states if s.kind == "recurrent")
        return (window + 1) * (self.activation_bytes_per_token() + 4 * self.model.vocab_size) + window * checkpoints


def dense_shapes(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every dense tensor the device holds, by canonical name (as a pack names them): the
    family's weight-name table (families/), less the host-kept embedding table."""
    shapes = m.spec.dense_shapes(m)
    return {n: shapes[n] for n in device_dense_names(m, shapes)}


def dense_bytes(shapes: dict[str, tuple], cb: int, dense_quant: str, m: ModelConfig | None = None) -> int:
    """Device bytes of the dense tensors; with --dense-quant, each quantisable matrix is int8
    codes plus one scale per row in the compute dtype, or int4 codes plus one fp16 scale per
    row and group of 32 (models/layers.py, Weights; pack/layout.py, dense_quantizable), in the
    shapes model m's family holds them in then (its quantised_shapes: MLA's absorbed projections)."""
    held = getattr(m.spec, "quantised_shapes", None) if m is not None and dense_quant != "off" else None
    shapes = held(m, shapes, dense_quant) if held else shapes
    total = 0
    for name, shape in shapes.items():
        if dense_quant == "off" or not dense_quantizable(name, tuple(shape), dense_quant):
            total += _numel(shape) * cb
        elif dense_quant == "int8":
            total += _numel(shape) + shape[0] * cb
        else:
            total += _numel(shape) // 2 + shape[0] * (shape[1] // DENSE_GROUP) * 2
    return total


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def device_dense_names(m: ModelConfig, names) -> list[str]:
    """The dense tensors that go to the device: all but an untied embedding table, which stays
    on the host (a lookup of a few rows per step), and the MTP layers' (a draft source's, placed
    in the reserve when speculation uses them)."""
    return [n for n in names if (m.tie_word_embeddings or n != "model.embed_tokens.weight")
            and mtp_index(n, m) is None]


def mtp_dense_names(m: ModelConfig, names) -> list[str]:
    """The first MTP layer's dense tensors: the one moefit drafts with (runtime/mtp.py)."""
    return [n for n in names if mtp_index(n, m) == 0]


def from_config(m: ModelConfig, recipe: str, compute_dtype: str, group_size: int = 32,
                dense_quant: str = "off") -> Footprint:
    sizes = expert_blob_sizes(m.hidden_size, m.expert_size, recipe, list(m.moe_layers), group_size)
    blobs = {(layer, e): sizes[layer] for layer in m.moe_layers for e in range(m.num_experts)}
    cb = COMPUTE_BYTES[compute_dtype]
    dense = dense_bytes(dense_shapes(m), cb, dense_quant, m)
    mtp = m.spec.mtp_shapes(m, 0) if m.mtp_layers else {}
    return Footprint(m, compute_dtype, dense, blobs, 0, m.mtp_layers, dense_bytes(mtp, cb, dense_quant, m))


def from_pack_header(header: dict, compute_dtype: str, dense_quant: str = "off") -> Footprint:
    m = ModelConfig.from_hf(header["model_config"])
    tensors = header["dense"]["tensors"]
    names = device_dense_names(m, tensors)
    dense = dense_bytes({n: tuple(tensors[n]["shape"]) for n in names}, COMPUTE_BYTES[compute_dtype], dense_quant, m)
    blobs = {(row[0], row[1]): row[3] for row in header["experts"]["index"] if row[0] < m.num_layers}
    cb = COMPUTE_BYTES[compute_dtype]
    draft = (header.get("draft") or {}).get("params", 0) * cb
    mtp = dense_bytes({n: tuple(tensors[n]["shape"]) for n in mtp_dense_names(m, tensors)}, cb, dense_quant, m)
    return Footprint(m, compute_dtype, dense, blobs, draft, (header.get("mtp") or {}).get("layers", 0), mtp,
                     (header.get("probe") or {}).get("params", 0) * cb)

"""A decode step as recorded pieces (--decode-graphs): each layer's attention issued as one launch.

Outside its experts a decode token issues ~75 torch operations a layer (norms, projections, rope,
the KV write, attention, the look-ahead's guess); on a GPU the host issues each, and on the H200
that dispatch, not the GPU, set the pace (bench/results/gpu-profile-h200-round23-*.txt). Here
each layer's part from its input to its MoE input is recorded once (runtime/recorders.py: a CUDA
graph, or a tape on a simulated card) and replayed each token; the MoE part runs as before
between the pieces (the router, the runner's hand-off with the host, the experts):

    head       cos, sin and the mask of the attended keys, from the position on the device
    layer i    x = x + moe (i > 0); x = x + attention_i(norm(x)); h_i = post_norm_i(x); guess_i+1;
               the router's weights and ids of h_i
    eager      moe = mlp_i(h_i, those)
    tail       out = norm(x + moe)

A piece may not read a Python position, so attention reads a bucket of the cache (256, 512, ...
positions: the least that holds this one) with the keys past the position masked, and writes
its key and value at the positions the device holds (the codec's put at an index tensor): a
piece recorded for a bucket serves each position in it, and a context of 128K records at most
ten buckets a layer. A verify window of T tokens (T <= 16) has pieces of its own, per T. What
the pieces leave each other lives in tensors made here (`Rows`: x, moe, h_i, the router's
output, the guesses), never in a recorder's pool.

It applies where the family says its attention reads the sequence state only through the view
below (`graph_step`), to a whole-context KV store (any KV dtype), a sliding window's ring and
Gated DeltaNet layers (whose state is updated in place; their bookkeeping runs before the
pieces; a window's checkpoints are written to a scratch in the piece and copied to the layer's
own after it); a prompt chunk and a KV cache streamed to the host run as before.

A ring (gpt-oss's sliding layers: window + one prompt chunk of slots, position p in slot
p % R) is read whole, under a mask made on the device from the positions its slots hold: the
pieces keep a copy of the layer's record of them on the card (`rings`), write this step's
positions into it as they write the rows, and the host's record takes the same positions before
the pieces run. An eager forward (a prompt chunk, a restored session) changes only the host's
record: its tensor version says so, and the card's copy is made equal again before the next step.
"""

from __future__ import annotations

import functools

import torch

from moefit.experts.grouped import DENSE_TOKENS
from moefit.models.layers import GUESS_RANKS, next_layer_guess, rms_norm
from moefit.runtime.recorders import RecordError, recorder_for
from moefit.runtime.recurrent_state import RecurrentLayerState
from moefit.runtime.state import AttentionState

MIN_BUCKET = 256


def why_not(model, states, device_kind: str) -> str | None:
    """Why a decode step cannot run as recorded pieces here, or None."""
    if device_kind == "cpu":
        return "the cpu device runs each layer's attention as one native call already"
    if not getattr(model, "graph_step", False):
        return f"{type(model).__name__}'s attention is not declared graph-safe (graph_step)"
    if not hasattr(model.rope, "at"):
        return "its rope has no angles from a device position"
    for layer in (x for s in states for x in s.layers):
        if isinstance(layer, AttentionState) and layer.host is not None:
            return "a layer's KV streams to the host (--kv-resident): its older positions are read there"
    return None


def bucket_of(pos: int, capacity: int) -> int:
    """The attended keys of a step at pos: the least power of two >= pos + 1 (at least MIN_BUCKET), within capacity."""
    return min(capacity, max(MIN_BUCKET, 1 << pos.bit_length()))


class BucketView:
    """The sequence state as a recorded piece sees it: writes at the positions the device holds,
    reads a bucket of rows, or a ring's every slot, and the mask of those a query attends
    (`attended`, which attend_state asks first: `recorded`); `layers` as the pieces see them
    (Begun for a recurrent layer). Every other question attend_state asks has the whole-context
    answer."""

    recorded = True

    def __init__(self, state, positions: torch.Tensor, bucket: int, layers: list, rings: dict[int, torch.Tensor]):
        self.state, self.positions, self.bucket, self.layers, self.rings = state, positions, bucket, layers, rings

    def write(self, i: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        layer, ring = self.state.layers[i], self.rings.get(i)
        at = self.positions if ring is None else self.positions % layer.capacity
        layer.kc.put(layer.k, at, k)                  # any codec: its rows put at the device's indices
        layer.vc.put(layer.v, at, v)
        if ring is not None:
            ring[at] = self.positions

    def parts(self, i: int, end: int, stored: bool = False) -> list[tuple]:
        layer = self.state.layers[i]
        rows, dt = slice(0, layer.capacity if i in self.rings else self.bucket), layer.compute_dtype
        return [(layer.kc.get(layer.k, rows, dt), layer.vc.get(layer.v, rows, dt), None)]

    def attended(self, i: int, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer i's rows (k, v) and which of them each query attends [T, S]: the step's causal mask
        over the bucket, or a ring's slots by the positions they hold (never-written and rejected
        ones are later than any query); within the layer's window where it has one."""
        (k, v, _), = self.parts(i, 0)
        layer, ring, q = self.state.layers[i], self.rings.get(i), self.positions[:, None]
        if ring is None and layer.window is None:
            return k, v, mask
        held = ring[None, :] if ring is not None else torch.arange(self.bucket, device=q.device)[None, :]
        allowed = held <= q
        if layer.window is not None:
            allowed = allowed & (q - held < layer.window)
        return k, v, allowed

    def rotations(self, i: int):
        return self.state.layers[i].rotations

    def window(self, i: int) -> None:
        return None

    def own_window(self, i: int) -> bool:
        return False

    def step_rows(self, i: int, pos: int) -> None:
        return None

    def recent_rows(self, i: int, end: int) -> None:
        return None

    def writable_rows(self, i: int) -> None:
        return None


class Begun:
    """A recurrent layer's state inside a piece: its begin() (Python bookkeeping, and at a resume a
    copy) ran before the piece (DecodeGraphs.forward); s and the conv window are the layer's. A
    verify window's checkpoints (the state after each position but the last) go to `saved`, a
    scratch every layer shares, and its conv inputs are kept here: `copy_out` gives both to the
    layer after its piece (its own checkpoints are taken in the verify arena each window)."""

    def __init__(self, state: RecurrentLayerState, saved: torch.Tensor | None):
        self._state, self.saved, self.conv_inputs = state, saved, None

    def begin(self, start: int, t: int) -> None:
        pass

    def save(self, i: int) -> None:
        self.saved[i].copy_(self._state.s)

    def copy_out(self) -> None:
        self._state.saved.copy_(self.saved)
        self._state.conv_inputs = self.conv_inputs.clone()

    def __getattr__(self, name: str):
        return getattr(self._state, name)


class Rows:
    """What the pieces of a forward of T tokens leave each other, made outside any recorder's pool:
    the residual stream x, the MoE output, each layer's MoE input h, router output and
    look-ahead guess, the positions, RoPE's angles and each bucket's mask. `zeros(shape, dtype)`
    makes them (on a card: charged to the reserve's decode graphs line)."""

    def __init__(self, model, t: int, zeros):
        e, dt, k = model.cfg.hidden_size, model.norm.dtype, model.cfg.top_k
        self.zeros = zeros
        self.t, self.positions = t, zeros((t,), torch.long)
        self.x, self.moe, self.out = zeros((t, e), dt), zeros((t, e), dt), zeros((t, e), dt)
        self.h = [zeros((t, e), dt) for _ in model.layers]
        ranks = min(GUESS_RANKS * k, model.cfg.num_experts)
        self.guess = [zeros((t, ranks), torch.long) for _ in model.layers]
        moe = [i for i, layer in enumerate(model.layers) if "router" in layer and hasattr(model, "route")]
        self.weights = {i: zeros((t, k), dt) for i in moe}
        self.ids = {i: zeros((t, k), torch.long) for i in moe}
        cos, sin = model.rope.at(self.positions)
        self.cos, self.sin = zeros(cos.shape, cos.dtype), zeros(sin.shape, sin.dtype)
        self.masks: dict[int, torch.Tensor] = {}
        self.checkpoints: torch.Tensor | None = None      # a window's DeltaNet states, every layer's in turn

    def tensors(self) -> list[torch.Tensor]:
        return [self.positions, self.x, self.moe, self.out, self.cos, self.sin, *self.h, *self.guess,
                *self.weights.values(), *self.ids.values(), *self.masks.values(),
                *([self.checkpoints] if self.checkpoints is not None else [])]

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors())

    def mask(self, bucket: int) -> torch.Tensor:
        if bucket not in self.masks:
            self.masks[bucket] = self.zeros((self.t, bucket), torch.bool)
        return self.masks[bucket]


class DecodeGraphs:
    """The pieces of one model's decode step (and verify window), recorded per (session state,
    layer, bucket, tokens)."""

    def __init__(self, model, device: torch.device, zeros=None):
        self.model, self.rec = model, recorder_for(device)
        self.zeros = zeros or (lambda shape, dtype: torch.zeros(shape, dtype=dtype, device=device))
        self.pos = self.zeros((1,), torch.long)
        self.rows: dict[int, Rows] = {}
        self._views: dict[tuple, list] = {}
        self.pieces: dict[tuple, tuple] = {}
        self.rings: dict[tuple, torch.Tensor] = {}     # (state, layer): the positions its ring's slots hold
        self._ring_versions: dict[tuple, int] = {}     # the host record's tensor version the copy matches
        self.replays = 0
        self.broken: str | None = None          # a capture that failed: later steps run as before

    def takes(self, tokens: int, state) -> bool:
        """A decode step or a verify window."""
        return tokens <= DENSE_TOKENS

    def _layers(self, state, rows: Rows) -> tuple[list, bool]:
        """state's layers as the pieces of a forward of rows.t tokens see them (the same objects
        each time: a recording holds them), and whether a window keeps DeltaNet checkpoints."""
        keeping = rows.t > 1 and any(getattr(x, "checkpointing", False) for x in state.layers)
        key = (state, rows.t, keeping)
        if key not in self._views:
            self._views[key] = [Begun(x, self._checkpoints(rows, x) if keeping else None)
                                if isinstance(x, RecurrentLayerState) else x for x in state.layers]
        return self._views[key], keeping

    @functools.cache
    def _capacity(self, state) -> int:
        """The positions every whole-context attention layer of state holds (a bucket is at most this)."""
        return min((x.capacity for x in state.layers if isinstance(x, AttentionState) and x.slot_pos is None),
                   default=MIN_BUCKET)

    def _rings(self, state, start: int, t: int) -> dict[int, torch.Tensor]:
        """Each ring layer's copy on the card of the positions its slots hold, made equal to the host's
        record where an eager forward changed it since; the host's record then takes positions
        start..start+t, which the pieces write into the copy."""
        rings = {}
        for i, layer in enumerate(state.layers):
            if not isinstance(layer, AttentionState) or layer.slot_pos is None:
                continue
            key, record = (state, i), layer.slot_pos
            if key not in self.rings:
                self.rings[key] = self.zeros(record.shape, record.dtype)
            if self._ring_versions.get(key) != record._version:     # torch counts each in-place write
                self.rings[key].copy_(record, non_blocking=True)     # CUDA stages pageable memory before
                                                                     # it returns: the record may change now
            layer.stepped(start, t)
            self._ring_versions[key] = record._version
            rings[i] = self.rings[key]
        return rings

    def _checkpoints(self, rows: Rows, layer: RecurrentLayerState) -> torch.Tensor:
        if rows.checkpoints is None:
            rows.checkpoints = self.zeros((rows.t - 1, *layer.s.shape), layer.s.dtype)
        return rows.checkpoints

    def forward(self, tokens: torch.Tensor, start: int, state, experts) -> torch.Tensor:
        """Final hidden states [T, E] of tokens at positions start.., as decoder_stack computes them."""
        m, t = self.model, tokens.shape[0]
        rows = self.rows.get(t) or self.rows.setdefault(t, Rows(m, t, self.zeros))
        bucket = bucket_of(start + t - 1, self._capacity(state))
        layers, keeping = self._layers(state, rows)
        view = BucketView(state, rows.positions, bucket, layers, self._rings(state, start, t))
        mask = rows.mask(bucket)
        self.pos.fill_(start)
        for layer in state.layers:                      # recurrent layers' bookkeeping: not in a piece
            if isinstance(layer, RecurrentLayerState):
                layer.begin(start, t)
        rows.x.copy_(m.embed[tokens].to(device=rows.x.device, dtype=rows.x.dtype))
        self._run(("head", t, bucket), functools.partial(self._head, rows, mask))
        look = experts.look_ahead
        for i, layer in enumerate(m.layers):
            guess = look and i + 1 < len(m.layers) and "router" in m.layers[i + 1]
            self._run((state, i, bucket, guess, t, keeping),
                      functools.partial(self._layer, rows, i, layer, view, mask, guess))
            if keeping and isinstance(layers[i], Begun):
                layers[i].copy_out()
            if guess:
                experts.expect(i + 1, rows.guess[i + 1], "router" in layer)
            routed = (rows.weights[i], rows.ids[i]) if i in rows.weights else None
            rows.moe.copy_(m.mlp(i, layer, rows.h[i], experts, routed))
        self._run(("tail", t), functools.partial(self._tail, rows))
        return rows.out.clone()

    def _run(self, key: tuple, piece) -> None:
        """Replay the piece recorded under key, or record it (which runs it)."""
        found = self.pieces.get(key)
        if found is not None:
            found()
            self.replays += 1
            return
        if self.broken is not None:
            piece()
            return
        try:
            self.pieces[key] = self.rec.record(piece)
        except RecordError as e:
            if self.rec.kind == "tape":          # the tape ran part of it: nothing to continue from
                raise
            self.broken = str(e)                 # CUDA ran it before the capture: this step is whole

    def _head(self, rows: Rows, mask: torch.Tensor) -> None:
        rows.positions.copy_(self.pos + torch.arange(rows.t, device=self.pos.device))
        cos, sin = self.model.rope.at(rows.positions)
        rows.cos.copy_(cos)
        rows.sin.copy_(sin)
        mask.copy_(torch.arange(mask.shape[1], device=mask.device)[None, :] <= rows.positions[:, None])

    def _layer(self, rows: Rows, i: int, layer: dict, view: BucketView, mask: torch.Tensor, guess: bool) -> None:
        m, eps = self.model, self.model.cfg.rms_norm_eps
        x = rows.x + rows.moe if i > 0 else rows.x
        x = x + m.attention(i, layer, rms_norm(x, layer["input_norm"], eps), view.bucket - rows.t, rows.cos,
                            rows.sin, mask, view)
        rows.x.copy_(x)
        if guess:
            rows.guess[i + 1].copy_(next_layer_guess(m, i + 1, x))
        h = rms_norm(x, layer["post_norm"], eps)
        rows.h[i].copy_(h)
        if i in rows.weights:                                 # the router too (the family's `route`)
            weights, ids = m.route(i, layer, h)
            rows.weights[i].copy_(weights)
            rows.ids[i].copy_(ids)

    def _tail(self, rows: Rows) -> None:
        rows.out.copy_(rms_norm(rows.x + rows.moe, self.model.norm, self.model.cfg.rms_norm_eps))

    def forget(self) -> None:
        """Drop every recording and its pool (the guard gives memory back): the next steps record again."""
        self.pieces.clear()
        self.rec = recorder_for(self.pos.device)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor made here (the reserve's decode graphs line on a card)."""
        return [self.pos, *(x for r in self.rows.values() for x in r.tensors()), *self.rings.values()]

    def to_json(self) -> dict:
        return {"recorder": self.rec.kind, "pieces": len(self.pieces), "replays": self.replays,
                "pool_bytes": self.rec.pool_bytes, "rows_bytes": sum(x.nbytes for x in self.tensors()),
                "broken": self.broken}

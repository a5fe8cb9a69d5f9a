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
its key and value at the position the device holds (index_copy_): a piece recorded for a bucket
serves each position in it, and a context of 128K records at most ten buckets a layer. What
the pieces leave each other lives in tensors made here (x, moe, h_i, the guesses), never in a
recorder's pool.

It applies where the family says its attention reads the sequence state only through the view
below (`graph_step`), to a whole-context KV store (any KV dtype) and Gated DeltaNet layers
(whose state is updated in place; their bookkeeping runs before the pieces), one token a
forward; a verify window, a prompt chunk, a ring or a streamed KV cache run as before.
"""

from __future__ import annotations

import functools

import torch

from moefit.models.layers import GUESS_RANKS, next_layer_guess, rms_norm
from moefit.runtime.recorders import RecordError, recorder_for
from moefit.runtime.state import AttentionState, RecurrentLayerState

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
        if isinstance(layer, RecurrentLayerState):
            continue
        if not isinstance(layer, AttentionState) or layer.slot_pos is not None or layer.window is not None:
            return "a layer's state is not a whole-context KV store (a ring, a window)"
    return None


def bucket_of(pos: int, capacity: int) -> int:
    """The attended keys of a step at pos: the least power of two >= pos + 1 (at least MIN_BUCKET), within capacity."""
    return min(capacity, max(MIN_BUCKET, 1 << pos.bit_length()))


class BucketView:
    """The sequence state as a recorded piece sees it: writes at the device's position, reads a
    bucket of rows. Every other question attend_state asks has the whole-context answer."""

    def __init__(self, state, pos: torch.Tensor, bucket: int):
        self.state, self.pos, self.bucket = state, pos, bucket
        self.layers = [Begun(x) if isinstance(x, RecurrentLayerState) else x for x in state.layers]

    def write(self, i: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        layer = self.state.layers[i]                  # any codec: its rows put at the device's index
        layer.kc.put(layer.k, self.pos, k)
        layer.vc.put(layer.v, self.pos, v)

    def parts(self, i: int, end: int, stored: bool = False) -> list[tuple]:
        layer, rows = self.state.layers[i], slice(0, self.bucket)
        dt = layer.compute_dtype
        return [(layer.kc.get(layer.k, rows, dt), layer.vc.get(layer.v, rows, dt), None)]

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
    copy) ran before the piece, each token (DecodeGraphs.forward); its tensors are the layer's."""

    def __init__(self, state: RecurrentLayerState):
        self._state = state

    def begin(self, start: int, t: int) -> None:
        pass

    def __getattr__(self, name: str):
        return getattr(self._state, name)


class DecodeGraphs:
    """The pieces of one model's decode step, recorded per (session state, layer, bucket)."""

    def __init__(self, model, device: torch.device):
        self.model, self.rec = model, recorder_for(device)
        e, dt = model.cfg.hidden_size, model.norm.dtype
        zeros = functools.partial(torch.zeros, dtype=dt, device=device)
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        self.x, self.moe, self.out = zeros(1, e), zeros(1, e), zeros(1, e)
        self.h = [zeros(1, e) for _ in model.layers]
        ranks = min(GUESS_RANKS * model.cfg.top_k, model.cfg.num_experts)
        self.guess = [torch.zeros(1, ranks, dtype=torch.long, device=device) for _ in model.layers]
        moe = [i for i, layer in enumerate(model.layers) if "router" in layer and hasattr(model, "route")]
        self.weights = {i: zeros(1, model.cfg.top_k) for i in moe}
        self.ids = {i: torch.zeros(1, model.cfg.top_k, dtype=torch.long, device=device) for i in moe}
        self.cos, self.sin = (t.clone() for t in model.rope.at(self.pos))
        self.masks: dict[int, torch.Tensor] = {}
        self.pieces: dict[tuple, tuple] = {}
        self.replays = 0
        self.broken: str | None = None          # a capture that failed: later steps run as before

    def forward(self, token: torch.Tensor, start: int, state, experts) -> torch.Tensor:
        """Final hidden states [1, E] of one token at position start, as decoder_stack computes them."""
        m = self.model
        bucket = bucket_of(start, min(x.capacity for x in state.layers if isinstance(x, AttentionState)))
        view = BucketView(state, self.pos, bucket)
        if bucket not in self.masks:
            self.masks[bucket] = torch.zeros(1, bucket, dtype=torch.bool, device=self.pos.device)
        self.pos.fill_(start)
        for layer in state.layers:                      # recurrent layers' bookkeeping: not in a piece
            if isinstance(layer, RecurrentLayerState):
                layer.begin(start, 1)
        self.x.copy_(m.embed[token].to(device=self.x.device, dtype=self.x.dtype))
        self._run(("head", bucket), functools.partial(self._head, bucket))
        look = experts.look_ahead
        for i, layer in enumerate(m.layers):
            guess = look and i + 1 < len(m.layers) and "router" in m.layers[i + 1]
            self._run((state, i, bucket, guess), functools.partial(self._layer, i, layer, bucket, view, guess))
            if guess:
                experts.expect(i + 1, self.guess[i + 1], "router" in layer)
            routed = (self.weights[i], self.ids[i]) if i in self.weights else None
            self.moe.copy_(m.mlp(i, layer, self.h[i], experts, routed))
        self._run(("tail",), self._tail)
        return self.out.clone()

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

    def _head(self, bucket: int) -> None:
        cos, sin = self.model.rope.at(self.pos)
        self.cos.copy_(cos)
        self.sin.copy_(sin)
        self.masks[bucket].copy_((torch.arange(bucket, device=self.pos.device) <= self.pos)[None])

    def _layer(self, i: int, layer: dict, bucket: int, view: BucketView, guess: bool) -> None:
        m, eps = self.model, self.model.cfg.rms_norm_eps
        x = self.x + self.moe if i > 0 else self.x
        x = x + m.attention(i, layer, rms_norm(x, layer["input_norm"], eps), bucket - 1, self.cos, self.sin,
                            self.masks[bucket], view)
        self.x.copy_(x)
        if guess:
            self.guess[i + 1].copy_(next_layer_guess(m, i + 1, x))
        h = rms_norm(x, layer["post_norm"], eps)
        self.h[i].copy_(h)
        if i in self.weights:                                 # the router too (the family's `route`)
            weights, ids = m.route(i, layer, h)
            self.weights[i].copy_(weights)
            self.ids[i].copy_(ids)

    def _tail(self) -> None:
        self.out.copy_(rms_norm(self.x + self.moe, self.model.norm, self.model.cfg.rms_norm_eps))

    def forget(self) -> None:
        """Drop every recording and its pool (the guard gives memory back): the next steps record again."""
        self.pieces.clear()
        self.rec = recorder_for(self.pos.device)

    def to_json(self) -> dict:
        return {"recorder": self.rec.kind, "pieces": len(self.pieces), "replays": self.replays,
                "pool_bytes": self.rec.pool_bytes, "broken": self.broken}

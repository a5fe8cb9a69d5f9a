"""Sessions kept across restarts (serve --keep-sessions), and a session copied into another (fork).

When the server stops, each held session's tokens and sequence state are written to
<state-dir>/sessions/<pack id>/session-N.safetensors: every attention layer's KV rows up to its
tokens (a ring's slots and the positions they hold, a streaming layer's host rows), every
recurrent layer's state at that position, the last prompt's end (hidden state and logits) and
an MTP drafter's rows. The next start of the same pack takes them back into its sessions, so an
agent's long prompt is not prefilled again: its next turn reuses the prefix as it would have
before the restart, and gives the same tokens.

A file is taken back whole or not at all: its fingerprint (moefit's version, the kernel
revision, the pack, and the flags that shape the numbers or the state's layout: FLAGS) and
every tensor's shape must be what this start allocated. Otherwise it is left alone, the start
says why, and the next stop replaces it. Taking it back writes into the state the plan already
charged: nothing new is allocated on the card.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from moefit import __version__, kernels
from moefit.runtime.session import PromptEnd
from moefit.runtime.recurrent_state import RecurrentLayerState
from moefit.runtime.state import AttentionState

FLAGS = ("device", "ctx", "kv_dtype", "kv_resident", "dense_quant", "compute_dtype", "prefill_chunk", "spec",
         "expert_gemm_rows")
FILE = "session-{}.safetensors"


def folder(state_dir: Path, engine) -> Path:
    return Path(state_dir) / "sessions" / engine.pack.pack_id


def fingerprint(engine) -> str:
    """What a kept state must have been made under to be taken back."""
    made = {"moefit": __version__, "kernels": kernels.REVISION, "pack": engine.pack.pack_id,
            "kv": engine.loaded.kv.kv_dtype, **{f: getattr(engine.cfg, f) for f in FLAGS}}
    return hashlib.sha256(json.dumps(made, sort_keys=True).encode()).hexdigest()[:16]


# -- one sequence state <-> named tensors ------------------------------------------------
def state_tensors(state, n: int, prefix: str = "", into: bool = False) -> dict[str, torch.Tensor] | None:
    """The tensors that put `state` (a SequenceState) at position n, as views of what it holds;
    `into`: where a restore writes them (a recurrent layer's current state). None where a
    recurrent layer holds no state at n."""
    out = {}
    for i, layer in enumerate(state.layers):
        views = layer_views(layer, n, into)
        if views is None:
            return None
        out.update({f"{prefix}{i}.{name}": t for name, t in views.items()})
    return out


def layer_views(layer, n: int, into: bool = False) -> dict[str, torch.Tensor] | None:
    if isinstance(layer, RecurrentLayerState):
        if into:
            return {"s": layer.s, "conv": layer.conv}
        held = layer.marks.get(n) or ((layer.s, layer.conv) if layer.pos == n else None) \
            or ((layer.snap_s, layer.snap_conv) if layer.snap_pos == n else None)
        return None if held is None else {"s": held[0], "conv": held[1]}
    assert isinstance(layer, AttentionState)
    m = min(n, layer.capacity)       # a ring: positions < n lie in its first n slots until it wraps
    views = {f"{kv}.{name}": t[:, :m] for kv, store in (("k", layer.k), ("v", layer.v)) for name, t in store.items()}
    if layer.slot_pos is not None:
        views["slot_pos"] = layer.slot_pos[:m]         # which position each slot holds (an older one: the host has it)
    if layer.host is not None:
        views.update({f"host.{kv}.{name}": t[:, :n] for kv, store in zip("kv", layer.host) for name, t in store.items()})
    return views


# -- a session <-> a file -----------------------------------------------------------------
def session_tensors(session) -> tuple[dict[str, torch.Tensor], dict[str, str]] | None:
    """Its state at n (the tokens every layer can resume after), the prompt ends kept before n (a
    recurrent layer's marks, their hidden states and logits: a chat's next turn resumes at the last
    prompt's end when the template rewrote the reply), and its MTP rows; None where it holds none."""
    n = session.state.resumable(len(session.tokens))
    tensors = state_tensors(session.state, n) if n else None
    if tensors is None:
        return None
    meta = {"tokens": json.dumps(session.tokens[:n])}
    for pos, end in session.ends.items():
        if pos <= n:
            tensors.update({f"end.{pos}.hidden": end.hidden, f"end.{pos}.logits": end.logits})
    for i, layer in enumerate(session.state.layers):
        for pos, (s, conv) in getattr(layer, "marks", {}).items():
            if pos <= n:
                tensors.update({f"{i}.mark.{pos}.s": s, f"{i}.mark.{pos}.conv": conv})
    mtp = session.mtp
    if mtp is not None and (rows := state_tensors(mtp.state, mtp.done, "mtp.")) is not None:
        tensors.update(rows)
        meta["mtp_done"] = str(mtp.done)
        if mtp.pending is not None:
            tensors["mtp.pending"] = mtp.pending
    return tensors, meta


def extra(name: str) -> bool:
    """A tensor a file may or may not hold (a prompt end, a mark, the MTP's pending rows)."""
    return name.startswith("end.") or ".mark." in name or name == "mtp.pending"


def save(engine, where: Path) -> list[str]:
    """Write every session that holds tokens (and remove the files of those that hold none): what
    was kept, a line each."""
    from safetensors.torch import save_file
    where.mkdir(parents=True, exist_ok=True)
    if engine.loaded.mem.torch_device.type == "cuda":
        torch.cuda.synchronize()                       # a streaming layer's write-through has landed
    said = []
    for i, session in enumerate(engine.sessions):
        path = where / FILE.format(i)
        got = session_tensors(session)
        if got is None:
            path.unlink(missing_ok=True)
            continue
        tensors, meta = got
        host = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
        tmp = path.with_suffix(".tmp")
        save_file(host, str(tmp), metadata={**meta, "fingerprint": fingerprint(engine)})
        os.replace(tmp, path)
        mib = sum(t.nbytes for t in host.values()) / 2**20
        said.append(f"session {i}: {len(json.loads(meta['tokens']))} tokens kept ({mib:.1f} MiB, {path})")
    return said


def restore(engine, where: Path) -> list[str]:
    """Take back the kept sessions that match this start: what was taken or left, a line each."""
    said = []
    for i, session in enumerate(engine.sessions):
        path = where / FILE.format(i)
        if path.exists():
            said.append(f"session {i}: " + _restore_one(engine, session, path))
    return said


def fork(engine, source, target) -> int:
    """target takes a copy of source's tokens and state, so that a request reusing source's prefix
    while source serves another starts at once (serve's worker); returns the tokens copied (0:
    source holds none every layer can resume after, target unchanged)."""
    if engine.loaded.mem.torch_device.type == "cuda":
        torch.cuda.synchronize()                       # a streaming layer's write-through has landed
    got = session_tensors(source)
    if got is None:
        return 0
    tensors, meta = got
    tokens = json.loads(meta["tokens"])
    views = _views(target, len(tokens), meta)
    held = {name: t.clone() if extra(name) else t for name, t in tensors.items()}   # marks are written over later
    marks = _marks(target, held)
    if views is None or marks is None:
        return 0
    _write_back(engine, target, tokens, views, held, meta, marks)
    return len(tokens)


def _restore_one(engine, session, path: Path) -> str:
    from safetensors import SafetensorError, safe_open
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("fingerprint") != fingerprint(engine):
                return "left: kept under another version, pack or flags"
            tokens = json.loads(meta["tokens"])
            views = _views(session, len(tokens), meta)
            if views is None or set(views) != {name for name in f.keys() if not extra(name)}:
                return "left: its layers are not this start's"
            loaded = {name: f.get_tensor(name) for name in f.keys()}
    except (OSError, SafetensorError, KeyError, ValueError) as e:
        return f"left: unreadable ({e})"
    marks = _marks(session, loaded)
    if marks is None or any(loaded[name].shape != t.shape or loaded[name].dtype != t.dtype for name, t in views.items()):
        return "left: its shapes are not this start's"
    _write_back(engine, session, tokens, views, loaded, meta, marks)
    return f"{len(tokens)} tokens taken back"


def _views(session, n: int, meta: dict) -> dict[str, torch.Tensor] | None:
    """Where each of a file's tensors goes in this session: its state at n, its MTP rows."""
    views = state_tensors(session.state, n, into=True) if n else None
    if views is None or ("mtp_done" in meta and session.mtp is None):
        return None
    if "mtp_done" in meta:
        views.update(state_tensors(session.mtp.state, int(meta["mtp_done"]), "mtp.", into=True))
    return views


def _marks(session, loaded: dict) -> dict[int, dict[int, tuple]] | None:
    """Each recurrent layer's marks in the file: layer -> {position: (s, conv)}; None where one
    is not shaped as the layer's state."""
    marks: dict[int, dict[int, tuple]] = {}
    for name in loaded:
        if ".mark." in name and name.endswith(".s"):
            i, _, pos, _ = name.split(".")
            layer = session.state.layers[int(i)]
            s, conv = loaded[name], loaded.get(name[:-2] + ".conv")
            if not isinstance(layer, RecurrentLayerState) or conv is None or s.shape != layer.s.shape \
                    or s.dtype != layer.s.dtype or conv.shape != layer.conv.shape or conv.dtype != layer.conv.dtype:
                return None
            pin = layer._pin
            marks.setdefault(int(i), {})[int(pos)] = (s.pin_memory() if pin else s, conv.pin_memory() if pin else conv)
    return marks


def _write_back(engine, session, tokens: list[int], views: dict, loaded: dict, meta: dict, marks: dict) -> None:
    with torch.inference_mode():
        for name, t in views.items():
            t.copy_(loaded[name])
    n = len(tokens)
    for i, layer in enumerate(session.state.layers):
        if isinstance(layer, RecurrentLayerState):
            layer.taken_back(n, marks.get(i, {}))
    session.tokens = list(tokens)
    session.ends.clear()
    for name in sorted((k for k in loaded if k.startswith("end.") and k.endswith(".hidden")), key=_position):
        pos = _position(name)
        if f"end.{pos}.logits" in loaded:
            session.ends[pos] = PromptEnd(loaded[name], loaded[f"end.{pos}.logits"])
    if session.mtp is not None:
        session.mtp.done = int(meta.get("mtp_done", 0))
        pending = loaded.get("mtp.pending")
        session.mtp.pending = pending.to(engine.loaded.mem.torch_device) if pending is not None else None


def _position(name: str) -> int:
    return int(name.split(".")[1])

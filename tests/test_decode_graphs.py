"""A decode step as recorded pieces (--decode-graphs, runtime/decode_graphs.py) on a simulated
card, where a tape stands in for CUDA graphs (runtime/recorders.py): it replays the aten
operations a piece issued on the tensors it was recorded with, so a Python value frozen into a
piece is wrong here as it would be in a graph. What differs on a GPU is the recorder, not the
pieces."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from moefit import kernels
from moefit.config import ServeConfig
from moefit.runtime import decode_graphs
from moefit.runtime.engine import Engine
from moefit.runtime.recorders import RecordError, Tape
from moefit.memory import ledger as L
from moefit.memory.allocator import block_bytes
from moefit.memory.footprint import from_pack_header
from moefit.runtime.sampler import SamplingParams

GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


@pytest.fixture
def small_buckets(monkeypatch):
    """Buckets of 16, 32, 64 keys: a 45-token request crosses two boundaries."""
    monkeypatch.setattr(decode_graphs, "MIN_BUCKET", 16)


def _engine(pack, card, graphs: str, **kw) -> Engine:
    return Engine.open(pack, ServeConfig(**{"device": f"sim:{card(256)}", "ctx": 128, "vram_reserve_mib": 1,
                                            "low_headroom_mib": 0, "min_expert_slots": 0, "expert_cache": "auto",
                                            "decode_graphs": graphs, **kw}))


def _teacher_forced(engine: Engine, tokens: list[int], prompt: int, torch_ops: bool = False) -> list[torch.Tensor]:
    """Each decode step's logits over `tokens`; torch_ops: the steps through torch's operations
    (a card's path) instead of the host's native calls."""
    engine.prefill(tokens[:prompt])
    with kernels.host_calls_off() if torch_ops else contextlib.nullcontext():
        return [engine.decode_step(tokens[p], p).float() for p in range(prompt, len(tokens))]


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "glm4_moe", "olmoe", "qwen3_5_moe", "qwen3_next",
                                    "deepseek_v3", "glm4_moe_lite", "gpt_oss"])
def test_recorded_pieces_give_the_logits_of_the_forward_across_buckets(family, packs, card, small_buckets):
    tokens = torch.randint(0, 300, (60,), generator=torch.Generator().manual_seed(1)).tolist()
    on, off = (_engine(packs(family, "fp32"), card, g) for g in ("on", "off"))    # (int4 experts on the host
    worst = max(float((a - b).abs().max() / b.abs().max())                          # round their inputs to 8 bits:
                for a, b in zip(_teacher_forced(on, tokens, 5), _teacher_forced(off, tokens, 5)))   # 1e-7 can flip one)
    assert worst < 1e-5                        # fp32: torch's ops in the pieces against the host's native ones
    m = on.pack.model
    assert on.graphs.to_json()["pieces"] == 3 * (m.num_layers + 1) + 1     # 3 buckets x (layers + head), the tail
    assert on.decode_graphs_json()["replays"] > 0 and on.decode_graphs_json()["broken"] is None


RINGS = {"prefill_chunk": 16}      # gpt-oss's sliding layers (window 8) hold 24 slots of the 128 positions


@pytest.mark.parametrize("family, kw", [("qwen3_moe", {}), ("deepseek_v3", {}), ("gpt_oss", RINGS)])
def test_verify_windows_replay_their_own_pieces_with_the_forwards_logits(family, kw, packs, card, small_buckets):
    """Windows of 2-5 tokens (each length recorded once per bucket), rejected tails written over
    by the next window, across two bucket boundaries (and a ring's wraps)."""
    tokens = torch.randint(0, 300, (60,), generator=torch.Generator().manual_seed(3)).tolist()
    engines, logits = {g: _engine(packs(family, "fp32"), card, g, **kw) for g in ("on", "off")}, {}
    for graphs, engine in engines.items():
        got, pos = [], 5
        engine.prefill(tokens[:5])
        for t in [4, 2, 5, 3] * 4:
            got.append(engine.forward(tokens[pos:pos + t], pos).float())
            pos += t - 1                                  # the window's last token rejected
        logits[graphs] = got
    assert max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(logits["on"], logits["off"])) < 1e-5
    assert {key[-1] for key in engines["on"].graphs.pieces if key[0] == "tail"} == {2, 3, 4, 5}
    assert engines["on"].graphs.replays > 0


@pytest.mark.parametrize("family, kw", [("qwen3_moe", {}), ("qwen3_5_moe", {}), ("gpt_oss", RINGS)])
def test_what_the_pieces_pass_each_other_is_a_reserve_line_of_its_own(family, kw, packs, card, small_buckets):
    """Every row the pieces pass each other (a step's and each window length's, each bucket's mask,
    a DeltaNet window's checkpoints, a ring's slot positions) is charged to the reserve's decode
    graphs line, which the plan holds (at most); without the pieces there is no such line."""
    tokens = torch.randint(0, 300, (60,), generator=torch.Generator().manual_seed(5)).tolist()
    big = lambda mib: card(1024)                                    # noqa: E731 - room for the recommended reserve
    engine = _engine(packs(family, "fp32"), big, "on", vram_reserve_mib=None, spec="lookup", **kw)   # windows of 2-5
    planned = next(p for p in engine.plan.line(L.RESERVE).parts if p.name == L.GRAPHS).bytes
    assert planned == engine.plan.reserve.graphs > 0
    engine.prefill(tokens[:5])
    pos = 5
    for t, kept in [(1, 1), (4, 2), (1, 1), (2, 2), (5, 1), (3, 3)] * 3:
        state = engine.session.state
        state.checkpoint(t > 1)
        engine.forward(tokens[pos:pos + t], pos)
        state.checkpoint(False)
        if t > 1:
            engine.keep(pos, tokens[pos:pos + kept])
        pos += kept
    mem, rows = engine.loaded.mem, engine.graphs.rows
    rings = list(engine.graphs.rings.values())
    assert len(rings) == (2 if family == "gpt_oss" else 0)
    fp = from_pack_header(engine.pack.header, "fp32")        # the plan's ring part: what they take, in CUDA's blocks
    assert fp.decode_graph_bytes(128, [], 16) - fp.decode_graph_bytes(128, [], 128) == sum(block_bytes(r.nbytes)
                                                                                        for r in rings)
    assert set(rows) == {1, 2, 3, 4, 5} and any(r.checkpoints is not None for r in rows.values()) == (family == "qwen3_5_moe")
    made = [engine.graphs.pos, *(t for r in rows.values() for t in r.tensors()), *rings]
    assert mem.charged[L.GRAPHS] == sum(mem.block(t.nbytes) for t in made) <= planned
    off = _engine(packs(family, "fp32"), big, "off", vram_reserve_mib=None)
    assert off.plan.reserve.graphs == 0 and L.GRAPHS not in [p.name for p in off.plan.line(L.RESERVE).parts]


def test_a_sliding_layers_ring_is_read_by_the_positions_its_slots_hold_on_the_card(packs, card, small_buckets):
    """gpt-oss's sliding layers as rings of 24 slots (window 8): decode steps through the ring's
    wraps, an eager forward of 20 tokens in between (the host's record of the slots changes
    without the pieces: the card's copy is made equal again), then steps again: the forward's
    logits; the card's copy is the host's record after each step."""
    tokens = torch.randint(0, 300, (90,), generator=torch.Generator().manual_seed(6)).tolist()
    engines = {g: _engine(packs("gpt_oss", "fp32"), card, g, **RINGS) for g in ("on", "off")}
    logits = {}
    for graphs, engine in engines.items():
        engine.prefill(tokens[:5])
        got = [engine.forward([tokens[p]], p).float() for p in range(5, 40)]
        got.append(engine.forward(tokens[40:60], 40).float())                        # eager: 20 > DENSE_TOKENS
        got += [engine.forward([tokens[p]], p).float() for p in range(60, 90)]
        logits[graphs] = got
    worst = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(logits["on"], logits["off"]))
    assert worst < 1e-5
    on, state = engines["on"], engines["on"].session.state
    rings = [i for i, x in enumerate(state.layers) if x.slot_pos is not None]
    assert rings == [0, 2] and state.layers[0].capacity == 24
    for i in rings:
        assert torch.equal(on.graphs.rings[(state, i)].cpu(), state.layers[i].slot_pos)
    assert on.graphs.replays > 0 and on.graphs.broken is None


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
def test_deltanet_windows_roll_back_from_checkpoints_their_pieces_wrote(family, packs, card, small_buckets):
    """A verify window over DeltaNet layers keeps the state after each position (written in the
    piece to a scratch, copied to the layer's own after it); keeping part of the window puts each
    layer back there: the next window's logits are the forward's."""
    tokens = torch.randint(0, 300, (60,), generator=torch.Generator().manual_seed(4)).tolist()
    engines, logits = {g: _engine(packs(family, "fp32"), card, g) for g in ("on", "off")}, {}
    for graphs, engine in engines.items():
        got, pos = [], 5
        engine.prefill(tokens[:5])
        for t, kept in [(4, 2), (3, 3), (5, 1), (2, 2)] * 3:
            state = engine.session.state
            state.checkpoint(True)
            got.append(engine.forward(tokens[pos:pos + t], pos).float())
            state.checkpoint(False)
            engine.keep(pos, tokens[pos:pos + kept])
            pos += kept
        logits[graphs] = got
    assert max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(logits["on"], logits["off"])) < 1e-5
    assert {key[-2] for key in engines["on"].graphs.pieces if len(key) == 6} == {2, 3, 4, 5}


@pytest.mark.parametrize("family, kw", [("qwen3_moe", {}), ("gpt_oss", RINGS)])
def test_greedy_tokens_do_not_change_with_decode_graphs_or_sessions(family, kw, packs, card, small_buckets):
    pack = packs(family, "int4")
    off = _engine(pack, card, "off", **kw)
    expect = [off.generate(p, GREEDY)[1].generated for p in ([1, 2, 3, 4, 5], [9, 8, 7])]
    on = _engine(pack, card, "on", sessions=2, **kw)
    got = [on.generate(p, GREEDY)[1].generated for p in ([1, 2, 3, 4, 5], [9, 8, 7])]
    assert got == expect
    assert on.generate([1, 2, 3, 4, 5], GREEDY)[1].generated == expect[0]    # the first session's pieces again


class _CountOps(TorchDispatchMode):
    ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        _CountOps.ops += 1
        return func(*args, **(kwargs or {}))


def _ops_outside_experts(engine: Engine) -> int:
    """The torch operations one decode step issues besides the runner's (a replay counts one)."""
    if engine.graphs:
        for key, replay in list(engine.graphs.pieces.items()):
            def one(replay=replay):
                with _disable_current_modes():
                    replay()
                _CountOps.ops += 1
            engine.graphs.pieces[key] = one
    run, inside = engine.runner.run, [0]

    def counted(*args, **kwargs):
        before = _CountOps.ops
        out = run(*args, **kwargs)
        inside[0] += _CountOps.ops - before
        return out
    engine.runner.run = counted
    _CountOps.ops = 0
    with _CountOps():
        engine.decode_step(7, 9)
    return _CountOps.ops - inside[0]


def test_a_decode_step_issues_a_few_operations_a_layer_besides_its_experts(packs, card):
    counts = {}
    for graphs in ("off", "on"):
        engine = _engine(packs("qwen3_moe", "int4"), card, graphs, compute_dtype="bf16")   # the CUDA path's dtype
        engine.generate([1, 2, 3, 4, 5], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        counts[graphs] = _ops_outside_experts(engine) / engine.pack.model.num_layers
    assert counts["on"] * 5 < counts["off"], counts      # measured: 80 a layer against 9


@pytest.fixture(scope="module")
def head_dim_32(tmp_path_factory):
    """The tiny Qwen3-MoE with heads of 32 (q4's group), fp32 experts."""
    import tiny
    from moefit.pack.convert import convert
    root = tmp_path_factory.mktemp("hd32")
    convert(tiny.build_checkpoint("qwen3_moe", root / "hf", head_dim=32), root / "pack", "fp32", progress=False)
    return root / "pack"


def test_a_model_wide_sliding_window_is_masked_in_the_pieces(tmp_path, card, small_buckets):
    """Mixtral's config may set one window for every layer (a whole-context store, the window
    in the mask): the pieces mask the bucket's keys before it too, and give the forward's logits."""
    import tiny
    from moefit.pack.convert import convert
    convert(tiny.build_checkpoint("mixtral", tmp_path / "hf", sliding_window=8), tmp_path / "pack", "fp32", progress=False)
    tokens = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(8)).tolist()
    on, off = (_engine(tmp_path / "pack", card, g) for g in ("on", "off"))
    assert on.session.state.layers[0].window == 8 and on.session.state.layers[0].slot_pos is None
    worst = max(float((a - b).abs().max() / b.abs().max())
                for a, b in zip(_teacher_forced(on, tokens, 5), _teacher_forced(off, tokens, 5)))
    assert worst < 1e-5 and on.graphs.replays > 0


@pytest.mark.parametrize("kv_dtype", ["int8", "q4", "k8v4", "bf16"])
def test_a_quantised_kv_cache_is_written_and_read_in_the_pieces_as_the_forward_does(kv_dtype, head_dim_32, card,
                                                                                    small_buckets):
    """The same codes and scales put at the device's position (q4's rows rotated, the query turned
    into their space and the output back), the bucket decoded and attended: the forward's logits.

    Within 2e-4, not fp32's 1e-5: the pieces' sums over a masked bucket are ~3e-7 from the
    forward's, so now and then a key or value element lands on the other side of a rounding
    boundary and is stored one code (bf16: one ulp) apart, for the rest of the request: ~3e-5 of
    the logits (measured: once in 35 steps for bf16 with transformers 5.25's random weights). A
    row written at the wrong position, with the wrong scale or unrotated is off by more than 1e-2."""
    tokens = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    on, off = (_engine(head_dim_32, card, g, kv_dtype=kv_dtype) for g in ("on", "off"))
    worst = max(float((a - b).abs().max() / b.abs().max()) for a, b in      # (the host's native step reads bf16
                zip(_teacher_forced(on, tokens, 5), _teacher_forced(off, tokens, 5, torch_ops=True)))  # rows 5e-5 off)
    assert on.graphs.replays > 0 and worst < 2e-4


@pytest.mark.parametrize("change, why", [
    ({"device": "cpu"}, "cpu device"),
    ({"kv_resident": "32", "prefill_chunk": 16}, "streams to the host"),
])
def test_where_pieces_cannot_be_recorded_the_step_runs_as_before_and_says_why(change, why, packs, card):
    engine = _engine(packs("qwen3_moe", "int4"), card, "on", **change)
    assert engine.graphs is None and why in engine.decode_graphs_json()["why_not"]
    assert engine.generate([1, 2, 3], SamplingParams(max_tokens=3, temperature=0))[1].generated


def test_a_family_that_does_not_declare_its_attention_graph_safe_runs_as_before(packs, card, monkeypatch):
    from moefit.models.gpt_oss import GptOss
    monkeypatch.setattr(GptOss, "graph_step", False)
    engine = _engine(packs("gpt_oss", "int4"), card, "on")
    assert "graph_step" in engine.decode_graphs_json()["why_not"]
    assert engine.generate([1, 2, 3], SamplingParams(max_tokens=3, temperature=0))[1].generated


def test_the_tape_replays_on_the_recorded_tensors_with_python_frozen():
    x, out, scale = torch.ones(3), torch.zeros(3), [2.0]
    replay = Tape().record(lambda: (out.copy_(x * scale[0]), x.add_(1)))
    assert out.tolist() == [2.0] * 3 and x.tolist() == [2.0] * 3     # recording ran it once
    scale[0] = 10.0                                                  # Python is not read again
    replay()
    assert out.tolist() == [4.0] * 3 and x.tolist() == [3.0] * 3


@pytest.mark.parametrize("piece", [lambda x: x.sum().item(), lambda x: x.nonzero(), lambda x: x[x > 0],
                                   lambda x: x.repeat_interleave(x.long()), lambda x: bool(x[0] > 0),
                                   lambda x: torch.equal(x, x)])
def test_a_piece_that_waits_for_the_device_cannot_be_recorded(piece):
    x = torch.ones(3)
    with pytest.raises(RecordError, match="waits for the device"):
        Tape().record(lambda: piece(x))


def test_when_the_guard_gives_memory_back_the_recordings_go_and_are_made_again(packs, card):
    from moefit.runtime.guard import Guard
    engine = _engine(packs("qwen3_moe", "int4"), card, "on")
    want = engine.generate([1, 2, 3, 4, 5], GREEDY)[1].generated
    assert engine.graphs.pieces
    Guard(engine, floor_bytes=0).shrink(engine.runner.pool.allocated // 4, "test")
    assert not engine.graphs.pieces and engine.graphs.rec.pool_bytes == 0
    off = _engine(packs("qwen3_moe", "int4"), card, "off")
    assert off.generate([1, 2, 3, 4, 5], GREEDY)[1].generated == want
    Guard(off, floor_bytes=0).shrink(off.runner.pool.allocated // 4, "test")
    assert engine.generate([9, 8, 7], GREEDY)[1].generated == off.generate([9, 8, 7], GREEDY)[1].generated
    assert engine.graphs.pieces


def test_generate_json_says_what_was_recorded_and_replayed(packs, card):
    """The user's way in: `moefit generate --decode-graphs on --json` on a simulated card."""
    import json
    import subprocess
    import sys
    run = subprocess.run([sys.executable, "-m", "moefit", "generate", str(packs("qwen3_moe", "int4")), "--prompt",
                          "the lantern", "--max-tokens", "6", "--ignore-eos", "--json", "--device", f"sim:{card(256)}",
                          "--vram-reserve-mib", "1", "--decode-graphs", "on"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout)["decode_graphs"]
    assert out["on"] and out["recorder"] == "tape" and out["replays"] > 0 and out["broken"] is None

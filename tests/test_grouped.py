"""The resident experts' device path in a few launches a layer (experts/grouped.py): the same
numbers as expert by expert, and a launch count that does not grow with the resident experts.

These run the CUDA path's code on CPU tensors (the slots of a simulated card): what differs on a
GPU is where the tensors live, not which operations are queued.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moefit import kernels
from moefit.experts.grouped import combine_matrix
from moefit.experts.groups import Groups, expert_forward


class CountOps(TorchDispatchMode):
    """Counts the aten operations issued: on a GPU each is (at least) one launch."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _engine(packs, card, family: str, quant: str):
    from moefit.config import ServeConfig
    from moefit.runtime.engine import Engine
    return Engine.open(packs(family, quant), ServeConfig(device=f"sim:{card(64)}", ctx=64, vram_reserve_mib=1,
                                                         low_headroom_mib=0, min_expert_slots=0, expert_cache="16"))


def _resident(runner, layer: int, experts: list[int]) -> None:
    """Exactly these experts of `layer` in the cache."""
    for key in [k for k in runner.slots if k[0] == layer and k[1] not in experts]:
        runner.unload(key)
    for e in experts:
        if (layer, e) not in runner.slots:
            if not runner.pool.free_slots((layer, e)):
                runner.unload(next(k for k in runner.book.coldest() if k[0] != layer))
            runner.load((layer, e))
        dict(runner.slots[(layer, e)])            # its part views, made at their first read: not a step's launches


def _expert_by_expert(runner, layer: int, x: torch.Tensor, groups: Groups) -> torch.Tensor:
    """The earlier rounds' device path: each resident expert on its own rows, its matrices
    dequantised (codes times scales in fp32, rounded once to x's dtype) and multiplied."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for i, e in enumerate(groups.experts):
        rows, w = groups.rows_of(i)
        y = expert_forward(x[rows], runner.slots[(layer, e)], runner.pack.blobs[(layer, e)].quant)
        out.index_add_(0, rows, y.float() * w[:, None])
    return out


def _routing(m, tokens: int, seed: int) -> tuple[torch.Tensor, Groups]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, m.hidden_size, generator=gen)
    ids = torch.stack([torch.randperm(m.num_experts, generator=gen)[: m.top_k] for _ in range(tokens)])
    return x, Groups.of(ids, torch.rand(tokens, m.top_k, generator=gen))


@pytest.mark.parametrize("quant", ["int8", "int4", "q8_0", "bf16"])
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_grouped_resident_experts_equal_expert_by_expert_and_the_host_call(quant, tokens, packs, card, monkeypatch):
    engine = _engine(packs, card, "qwen3_moe", quant)
    runner, m = engine.runner, engine.pack.model
    assert runner.group == engine.plan.resident_group > 1       # a 64 MiB card: 1 % of it holds several
    assert runner.slice_weights == engine.plan.expert_slice >= 2 * m.expert_size * m.hidden_size   # whole
    layer = m.moe_layers[0]
    x, groups = _routing(m, tokens, seed=tokens)
    _resident(runner, layer, groups.experts)
    host = runner._host_experts(layer, x, groups)
    monkeypatch.setattr(kernels, "usable", lambda x, quant: False)     # the device path runs torch, as on a GPU
    grouped = runner._device_experts(layer, x, groups)
    one_by_one = _expert_by_expert(runner, layer, x, groups)
    assert grouped.dtype == torch.float32
    torch.testing.assert_close(grouped, one_by_one, rtol=1e-5, atol=1e-5)
    # the host's call rounds activations to 8 bits (bf16 experts: to bf16 here, not there)
    assert float((grouped - host).norm() / host.norm()) < 0.02

def test_a_decode_step_queues_the_same_launches_for_two_resident_experts_as_for_eight(packs, card, monkeypatch):
    """Per expert, an int4 SwiGLU is a couple of dozen launches; grouped, the layer's count is
    the same however many of its experts are resident (up to a group of 8)."""
    engine = _engine(packs, card, "qwen3_moe", "int4")
    runner, m = engine.runner, engine.pack.model
    runner.group, runner.slice_weights = 8, 1 << 62
    layer = m.moe_layers[0]
    x = torch.randn(1, m.hidden_size)

    def launches(experts: list[int]) -> int:
        _resident(runner, layer, experts)
        groups = Groups.of(torch.tensor([experts]), torch.rand(1, len(experts)))
        with CountOps() as count:
            runner._device_experts(layer, x, groups)
        return count.ops
    grouped = (launches([1, 5]), launches(list(range(8))))
    monkeypatch.setattr(runner, "_device_experts", lambda layer, x, groups: _expert_by_expert(runner, layer, x, groups))
    monkeypatch.setattr(kernels, "usable", lambda x, quant: False)
    one_by_one = (launches([1, 5]), launches(list(range(8))))
    assert grouped[0] == grouped[1]
    assert one_by_one[1] - one_by_one[0] >= 6 * 10                   # each extra expert: 10+ more
    assert grouped[1] * 3 < one_by_one[1]


def test_the_combine_matrix_holds_each_tokens_router_weight_for_its_experts():
    ids = torch.tensor([[3, 1], [1, 0], [3, 0]])
    weights = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.9, 0.1]])
    groups = Groups.of(ids, weights)
    combine = combine_matrix(len(groups.experts), 3, groups.rows, groups.start, groups.weights)
    assert groups.experts == [0, 1, 3]
    torch.testing.assert_close(combine, torch.tensor([[0.0, 0.3, 0.1], [0.4, 0.7, 0.0], [0.6, 0.0, 0.9]]))


@pytest.mark.parametrize("quant", ["int4", "q8_0"])
def test_in_bf16_the_grouped_path_stays_as_close_to_the_exact_weights_as_a_bf16_matrix_does(quant, packs, card,
                                                                                          monkeypatch):
    """Per-group scales after the multiply: in bf16 the grouped path's error against the fp32
    answer is no larger than that of multiplying by the dequantised bf16 matrix."""
    engine = _engine(packs, card, "qwen3_moe", quant)
    runner, m = engine.runner, engine.pack.model
    layer = m.moe_layers[0]
    x, groups = _routing(m, 2, seed=7)
    _resident(runner, layer, groups.experts)
    monkeypatch.setattr(kernels, "usable", lambda x, quant: False)
    exact = runner._device_experts(layer, x, groups)
    grouped = runner._device_experts(layer, x.bfloat16(), groups)
    one_by_one = _expert_by_expert(runner, layer, x.bfloat16(), groups)
    err = [float((y - exact).norm() / exact.norm()) for y in (grouped, one_by_one)]
    assert err[0] < 0.02 and err[0] <= err[1] * 1.25, err


@pytest.mark.parametrize("quant", ["int4", "int8"])
@pytest.mark.parametrize("tokens", [1, 40])
def test_an_expert_multiplied_in_row_slices_gives_the_same_sum(quant, tokens, packs, card, monkeypatch):
    """Where one expert's scratch would exceed the plan's share of the card (Mixtral on 12 GiB),
    its matrices go in slices of rows: the same numbers."""
    engine = _engine(packs, card, "qwen3_moe", quant)
    runner, m = engine.runner, engine.pack.model
    layer = m.moe_layers[0]
    x, groups = _routing(m, tokens, seed=3)
    _resident(runner, layer, groups.experts)
    monkeypatch.setattr(kernels, "usable", lambda x, quant: False)
    whole = runner._device_experts(layer, x, groups)
    runner.slice_weights = 5 * max(m.hidden_size, m.expert_size)          # 5 rows or more a slice
    torch.testing.assert_close(runner._device_experts(layer, x, groups), whole, rtol=1e-5, atol=1e-5)


def test_the_plan_holds_the_resident_experts_scratch_and_slices_what_one_expert_would_overrun():
    """1 % of the card for the resident experts' scratch: a 12 GiB card multiplies 3 of
    Qwen3-30B-A3B's experts at once, and one Mixtral-8x7B expert in slices; the prompt-path line
    holds exactly that scratch."""
    from pathlib import Path

    from moefit.config import ModelConfig
    from moefit.memory.footprint import from_config
    configs = Path(__file__).resolve().parent.parent / "configs"
    card = 12 << 30
    qwen = from_config(ModelConfig.from_hf_file(configs / "qwen3-30b-a3b.json"), "int4", "bf16")
    group, weights = qwen.resident_group(card)
    assert group == 3 and weights == 2 * 768 * 2048
    assert qwen.expert_scratch_bytes(group, weights) <= card // 100
    plain = qwen.prompt_path_bytes(512, 4096, "bf16")
    assert qwen.prompt_path_bytes(512, 4096, "bf16", group=(group, weights)) - plain == \
        qwen.expert_scratch_bytes(group, weights) - qwen.expert_scratch_bytes(1, 1 << 62)
    mixtral = from_config(ModelConfig.from_hf_file(configs / "mixtral-8x7b.json"), "int4", "bf16")
    group, weights = mixtral.resident_group(card)
    assert group == 1 and weights < 2 * 14336 * 4096
    assert mixtral.expert_scratch_bytes(group, weights) <= card // 100


def test_a_prefill_step_runs_its_resident_experts_a_group_at_a_time_on_their_own_rows(packs, card, monkeypatch):
    """40 rows (past the all-rows path): each group's experts on their own rows padded to the
    longest; the same sums as one at a time, in fewer operations (a prefill group is at most
    top-k experts, this model's 2: about half the operations)."""
    engine = _engine(packs, card, "qwen3_moe", "int4")
    runner, m = engine.runner, engine.pack.model
    layer = m.moe_layers[0]
    x, groups = _routing(m, 40, seed=5)
    _resident(runner, layer, groups.experts)
    monkeypatch.setattr(kernels, "usable", lambda x, quant: False)
    counted = {}
    for group in (8, 1):
        runner.group = group
        with CountOps() as count:
            counted[group] = runner._device_experts(layer, x, groups)
        counted[group, "ops"] = count.ops
    torch.testing.assert_close(counted[8], counted[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(counted[8], _expert_by_expert(runner, layer, x, groups), rtol=1e-5, atol=1e-5)
    assert m.top_k == 2 and counted[8, "ops"] < 0.65 * counted[1, "ops"], counted


class HostPeak(TorchDispatchMode):
    """The most host memory in use (glibc's count) after any operation, less what was in use
    before: on CPU tensors, the scratch a device step's operations hold at once."""

    def __init__(self):
        import ctypes

        class Mallinfo2(ctypes.Structure):
            _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                       "fsmblks", "uordblks", "fordblks", "keepcost")]
        super().__init__()
        libc = ctypes.CDLL(None)
        self.info = libc.mallinfo2
        self.info.restype = Mallinfo2
        self.peak = 0

    @staticmethod
    def available() -> bool:
        import ctypes
        return hasattr(ctypes.CDLL(None), "mallinfo2")

    def used(self) -> int:
        m = self.info()
        return m.uordblks + m.hblkhd

    def __enter__(self):
        self.base = self.used()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, self.used() - self.base)
        return out


@pytest.mark.parametrize("rows", [1, 40])
@pytest.mark.parametrize("quant", ["int8", "int4", "q8_0", "q4_k", "q5_k", "q6_k", "iq4_xs", "mxfp4"])
def test_a_device_multiply_holds_no_more_scratch_a_weight_than_the_plan(quant, rows):
    """The plan's scratch line counts expert_scratch_per_weight bytes a weight of the slice being
    multiplied; the dequantisation of a K-quant once held 20-29 (int64 codes). In fp32 (a bf16
    matmul on the CPU takes fp32 copies that a GPU's does not)."""
    if not HostPeak.available():
        pytest.skip("needs glibc's mallinfo2")
    from moefit.experts.grouped import _batched_linear
    from moefit.memory.footprint import Footprint
    from test_kernels import matrix
    r, c = 512, 2048
    parts = {k: v[None] for k, v in zip(["w", "w.scale"], matrix(quant, r, c, torch.Generator().manual_seed(0)))}
    x = torch.randn(rows, c)
    for _ in range(2):                                 # the second: the first holds one-time allocations
        with HostPeak() as peak:
            _batched_linear(x, parts, "w", quant)
    planned = Footprint(None, "fp32", 0, {}).expert_scratch_per_weight()
    assert 0 < peak.peak / (r * c) <= planned


@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_a_familys_own_expert_function_runs_grouped_on_the_device_too(tokens, packs, card, monkeypatch):
    """gpt-oss's experts (biases, a clamped gate) a group at a time, as SwiGLU experts are: the
    same sums as its expert function one expert at a time, and a decode step's launches the same
    for two resident experts as for eight."""
    engine = _engine(packs, card, "gpt_oss", "int4")
    runner, m = engine.runner, engine.pack.model
    assert runner.group_act is not None
    layer = m.moe_layers[0]
    x, groups = _routing(m, tokens, seed=tokens)
    _resident(runner, layer, groups.experts)
    host = runner._host_experts(layer, x, groups)                     # the native call, with gpt-oss's gate
    monkeypatch.setattr(kernels, "usable", lambda x, quant: False)
    grouped = runner._device_experts(layer, x, groups)
    one_by_one = torch.zeros(x.shape)
    for i, e in enumerate(groups.experts):
        rows, w = groups.rows_of(i)
        y = runner.expert_fn(layer, e, x[rows], runner.slots[(layer, e)], runner.pack.blobs[(layer, e)].quant)
        one_by_one.index_add_(0, rows, y.float() * w[:, None])
    torch.testing.assert_close(grouped, one_by_one, rtol=1e-5, atol=1e-5)
    assert float((grouped - host).norm() / host.norm()) < 0.02
    if tokens == 1:
        runner.group, runner.slice_weights = 8, 1 << 62

        def launches(experts: list[int]) -> int:
            _resident(runner, layer, experts)
            with CountOps() as count:
                runner._device_experts(layer, x, Groups.of(torch.tensor([experts]), torch.rand(1, len(experts))))
            return count.ops
        assert launches([1, 5]) == launches(list(range(8)))


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_a_prefill_groups_padded_rows_stay_within_the_prompt_paths_activations(family, packs, card, monkeypatch):
    """Worst padding: every token of a full chunk routes to the same experts, so each member of a
    group runs on all of the chunk's rows. What the step holds at once (on CPU tensors) is within
    what the plan's prompt-path line holds for a chunk's activations and the experts' scratch."""
    if not HostPeak.available():
        pytest.skip("needs glibc's mallinfo2")
    from moefit.memory.footprint import from_pack_header
    engine = _engine(packs, card, family, "int4")
    runner, m = engine.runner, engine.pack.model
    layer, chunk = m.moe_layers[0], engine.cfg.prefill_chunk
    experts = list(range(m.top_k))
    _resident(runner, layer, experts)
    x = torch.randn(chunk, m.hidden_size)
    groups = Groups.of(torch.tensor([experts] * chunk), torch.rand(chunk, m.top_k))
    monkeypatch.setattr(kernels, "usable", lambda x, quant: False)
    for _ in range(2):                                 # the second: the first holds one-time allocations
        with HostPeak() as peak:
            runner._device_experts(layer, x, groups)
    fp = from_pack_header(engine.pack.header, "fp32")
    planned = chunk * fp.activation_bytes_per_token() + fp.expert_scratch_bytes(runner.group, runner.slice_weights)
    assert 0 < peak.peak <= planned

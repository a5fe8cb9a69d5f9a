"""int4 experts the host computes, held in the kernel's panel order (experts/host_panels.py): the
same numbers bit for bit as from the pack's rows, on cpu and beside a simulated card's slots,
within the budget, and reported. This machine's own body runs in-process; AVX2's and AVX-VNNI's in
subprocesses capped with MOEFIT_ISA, so an AVX512 machine runs every tile."""

import pytest
import torch

from moefit import kernels
from moefit.config import ServeConfig
from moefit.errors import UsageError
from moefit.experts import host_panels
from moefit.experts.host_panels import HostPanels
from moefit.pack.quant import quantize
from moefit.runtime.engine import Engine
from moefit.runtime.sampler import SamplingParams
from narrow_isa import run_under

PROMPT = [5, 17, 42, 99, 7, 3, 150, 220, 31, 64, 12, 8]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def expert(rows: int = 64, cols: int = 96, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    gu = quantize(torch.randn(rows, cols, generator=g), "int4", 32)
    dn = quantize(torch.randn(cols, rows // 2, generator=g), "int4", 32)
    return dict(zip(["gate_up", "gate_up.scale", "down", "down.scale"], gu + dn))


def test_the_budget_follows_the_setting(monkeypatch):
    monkeypatch.setattr(kernels, "int4_panels", lambda: True)
    assert host_panels.budget_bytes("auto", 10 << 30, 8 << 30) == 4 << 30       # half of what is available
    assert host_panels.budget_bytes("auto", 1 << 30, 8 << 30) == 1 << 30       # at most the int4 experts
    assert host_panels.budget_bytes("300", 10 << 30, 8 << 30) == 300 << 20
    assert host_panels.budget_bytes("off", 10 << 30, 8 << 30) == 0
    monkeypatch.setattr(kernels, "int4_panels", lambda: False)                 # a body that reads rows
    assert host_panels.budget_bytes("auto", 10 << 30, 8 << 30) == 0
    with pytest.raises(UsageError, match="auto, off or a number of MiB"):
        host_panels.check_setting("lots")


def test_copies_are_made_once_within_the_budget():
    parts = expert()
    size = sum(t.nbytes for t in parts.values())
    held = HostPanels(budget=2 * size)
    first = held.parts((1, 0), parts, "int4")
    assert first is not None and held.parts((1, 0), parts, "int4") is first         # made once
    assert torch.equal(first["gate_up"], kernels.rows_to_panels(parts["gate_up"], parts["gate_up.scale"])[0])
    assert held.parts((1, 1), expert(seed=1), "int4") is not None
    assert held.parts((1, 2), expert(seed=2), "int4") is None                      # over the budget: rows
    assert held.parts((1, 3), expert(seed=3), "int8") is None                      # not int4
    assert held.report() == {"experts": 2, "making": 0, "bytes": 2 * size, "budget": 2 * size}
    assert HostPanels().parts((1, 0), parts, "int4") is None                       # off


def check_experts_in_panels() -> str:
    """One native call over four int4 experts, two held in panels and two in rows (a simulated
    card's slots beside host copies), 1 and 5 tokens: the outputs equal all-rows bit for bit.
    Where the body reads rows, a call naming panels is refused (None), never misread."""
    experts = [expert(seed=s) for s in range(4)]
    held = [dict(p, **dict(zip(["gate_up", "gate_up.scale"], kernels.rows_to_panels(p["gate_up"], p["gate_up.scale"]))),
                 **dict(zip(["down", "down.scale"], kernels.rows_to_panels(p["down"], p["down.scale"]))))
            for p in experts]
    g = torch.Generator().manual_seed(9)
    for tokens in (1, 5):
        x = torch.randn(tokens, 96, generator=g)
        rows = [torch.arange(tokens)] * 4
        weights = [torch.rand(tokens, generator=g) for _ in range(4)]
        want = kernels.moe_layer(x, "int4", experts, rows, weights)
        mixed = [held[0], experts[1], held[2], experts[3]]
        got = kernels.moe_layer(x, "int4", mixed, rows, weights, panels=[True, False, True, False])
        if kernels.int4_panels():
            assert got is not None and torch.equal(got, want), tokens
        else:
            assert got is None
    return kernels.isa()


def check_engine(pack: str, card: str) -> str:
    """Greedy tokens and prompt logits with the host's int4 experts in panels equal those read
    from the pack's rows: on cpu, and on a simulated card holding three experts in its slots
    (the rest computed on the host, slots in rows beside copies in panels in one call)."""
    def run(**flags):
        engine = Engine.open(pack, ServeConfig(ctx=64, **flags))
        logits = engine.prefill(PROMPT)[0].clone()
        engine.kv_tokens = []
        return engine, logits, engine.generate(PROMPT, GREEDY)[1].generated

    _, want_logits, want = run(host_panels="off")
    sim = dict(device=f"sim:{card}", vram_reserve_mib=1, low_headroom_mib=0, min_expert_slots=0, expert_cache="3")
    for flags in ({}, sim):
        engine, logits, tokens = run(host_panels="auto", **flags)
        assert tokens == want and torch.equal(logits, want_logits), flags
        report = engine.runner.panels.report()
        made = report["experts"] + report["making"]            # made on the engine's worker
        assert made > 0 if kernels.int4_panels() else made == 0, flags
    return kernels.isa()


@pytest.mark.parametrize("isa", [None, "avx2", "avx-vnni"])
def test_experts_in_panels_give_the_numbers_of_rows(isa):
    _run(isa, check_experts_in_panels)


@pytest.mark.parametrize("isa", [None, "avx2", "avx-vnni"])
def test_the_engine_gives_the_same_tokens_with_host_panels(packs, card, isa):
    pack, path = packs("qwen3_moe", "int4"), card(64)
    _run(isa, check_engine, str(pack), str(path))


def _run(isa: str | None, check, *args: str) -> None:
    """check(*args) in-process with this CPU's own body (isa None), or in a subprocess capped at isa."""
    if isa is None:
        check(*args)
        return
    call = f"from test_host_panels import {check.__name__}; print({check.__name__}(*{args!r}))"
    assert run_under(isa, call).strip().splitlines()[-1] == isa


def test_a_host_expert_reads_its_rows_until_the_worker_has_made_its_panels(packs):
    import threading

    from moefit.config import ServeConfig
    from moefit.runtime.engine import Engine
    if not kernels.int4_panels():
        pytest.skip("this CPU's int4 body reads rows")
    runner = Engine.open(packs("qwen3_moe", "int4"), ServeConfig(ctx=64)).runner
    key = (runner.pack.model.moe_layers[0], 3)
    first = runner._pointers(*key[:1], [key[1]])                   # the first use asks the worker for the copy
    assert first == kernels.addresses(runner._host_parts[key], panels=False)
    done = threading.Event()
    runner.staging().call(done.set)                                # after the copy, on the same worker
    assert done.wait(30) and runner.panels.holds(key)
    after = runner._pointers(*key[:1], [key[1]])
    assert after == kernels.addresses(runner.panels._held[key], panels=True) and after != first

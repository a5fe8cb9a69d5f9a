"""The expert cache's slot pool on a simulated card that charges like PyTorch's CUDA caching
allocator: what a per-expert allocation costs, and that the pool's ledger line is what the
card reserves for it, given back chunk by chunk."""

import pytest
import torch

from moefit.experts.pool import FREE, RESIDENT, SlotPool
from moefit.experts.slots import chunk_plan, pool_bytes, slots_bytes, stride
from moefit.memory.allocator import MIB, AllocatorModel
from moefit.memory.devices import open_device
from moefit.memory.simcard import write_card
from moefit.runtime.placement import DeviceMemory

# a Qwen3-30B-A3B int4 expert: gate_up [1536, 2048] and down [2048, 768] in 4 bits, fp16 scales per 32
BLOB = 1536 * 2048 // 2 + 2048 * 768 // 2 + 1536 * 64 * 2 + 2048 * 24 * 2          # 2.53 MiB


def cuda_card(tmp_path, total_mib=12282):
    path = tmp_path / "card.json"
    write_card(path, "RTX 4070 (simulated)", total_mib, [(2101, "gnome-shell", 587)], allocator="cuda")
    return DeviceMemory(open_device(f"sim:{path}"))


def test_the_cuda_model_rounds_blocks_and_reserves_segments():
    a = AllocatorModel("cuda")
    small = a.allocate(1000)                        # a 512-byte multiple, in a 2 MiB small segment
    assert (a.allocated, a.reserved) == (1024, 2 * MIB)
    mid = [a.allocate(BLOB) for _ in range(7)]      # 1-10 MiB blocks share 20 MiB segments: 7 of these
    assert a.reserved == 2 * MIB + 20 * MIB
    mid.append(a.allocate(BLOB))
    assert a.reserved == 2 * MIB + 40 * MIB
    a.allocate(33 * MIB + 1)                        # 10 MiB and up: its own segment, 2 MiB rounded
    assert a.reserved == 2 * MIB + 40 * MIB + 34 * MIB
    for h in mid[:6]:
        a.free(h)
    assert a.empty_cache() == 0                     # each segment still holds a block: nothing returns
    a.free(mid[6])
    a.free(small)
    assert a.empty_cache() == 22 * MIB


def test_experts_allocated_one_by_one_reserve_more_than_the_ledger_and_evicting_returns_nothing(tmp_path):
    """The problem the pool solves, in the model's arithmetic."""
    mem = cuda_card(tmp_path)
    blobs = [mem.empty("expert cache", (BLOB,), torch.uint8) for _ in range(80)]
    sim = mem.device.sim
    assert mem.charged["expert cache"] == 80 * BLOB
    assert sim.charged == 12 * 20 * MIB > 1.18 * 80 * BLOB   # 7 a segment: 12 segments of 20 MiB
    for t in blobs[::2]:                                      # the guard evicts half of them
        mem.free("expert cache", t)
    mem.release_cached()
    assert sim.charged == 12 * 20 * MIB                       # every segment still holds a block


def test_the_pool_reserves_exactly_its_ledger_line_and_gives_back_whole_chunks(tmp_path):
    mem = cuda_card(tmp_path)
    keys = [(layer, e) for layer in range(12) for e in range(40)]
    sizes = {k: BLOB for k in keys}
    pool = SlotPool(mem, sizes, 12, 128)
    free_before = mem.snapshot().free_bytes
    assert pool.reserve(keys) == len(keys)
    assert pool.allocated == pool_bytes(keys, sizes) == slots_bytes(len(keys), BLOB) == mem.charged["expert cache"]
    assert mem.device.sim.charged == pool.allocated                # reserved == allocated: no segment slack
    assert free_before - mem.snapshot().free_bytes == pool.allocated
    assert all(c.storage.numel() >= 10 * MIB for c in pool.chunks)
    assert len(pool.chunks) == len(chunk_plan(len(keys), stride(BLOB))) >= 16

    for i, k in enumerate(keys):
        pool.acquire(k).fill_(i % 251)
        pool.ready(k)
    assert pool.state(keys[0]) == RESIDENT and (pool.table >= 0).sum() == len(keys)
    sizes[(11, 99)] = BLOB                                        # one more of the class: no slot left for it
    assert pool.free_slots(keys[0]) == 0 and pool.acquire((11, 99)) is None
    for k in keys[::3]:                                           # evict a third, spread over every chunk
        pool.release(k)
    assert pool.state(keys[0]) == FREE and pool.free_slots(keys[0]) == len(keys[::3])
    freed, moved = pool.trim()
    assert pool.free_slots(keys[0]) == sum(len(c.free) for c in pool.chunks) < len(keys[::3])
    mem.release_cached()
    assert freed > 0 and moved                                     # residents moved out of the freed chunks
    assert mem.device.sim.charged == pool.allocated == slots_bytes(len(keys), BLOB) - freed
    assert free_before - mem.snapshot().free_bytes == pool.allocated
    for i, k in enumerate(keys):                                  # every resident kept its bytes
        if i % 3:
            assert int(pool.view(k)[0]) == i % 251 and int(pool.view(k)[-1]) == i % 251
    assert (pool.table >= 0).sum() == len(keys) - len(keys[::3])


def test_a_pool_that_does_not_fit_takes_the_largest_last_chunk_that_does(tmp_path):
    mem = cuda_card(tmp_path, total_mib=587 + 100)
    keys = [(0, e) for e in range(80)]
    pool = SlotPool(mem, {k: BLOB for k in keys}, 1, 80)
    made = pool.reserve(keys, keep_free=20 * MIB)
    assert 0 < made < 80
    assert mem.snapshot().free_bytes >= 20 * MIB
    assert sum(c.slots for c in pool.chunks) >= made


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("tokens", [1, 5])
def test_the_split_path_resident_on_the_device_and_misses_on_the_host_gives_the_same_sum(family, tokens, packs,
                                                                                      card):
    """What CUDA runs (resident experts from their pool slots through torch, misses through the
    host's call, joined by the hand-off) equals the one host call, on the same experts."""
    from moefit.config import ServeConfig
    from moefit.experts.runner import Groups
    from moefit.runtime.engine import Engine
    engine = Engine.open(packs(family, "int8"), ServeConfig(device=f"sim:{card(64)}", ctx=64, vram_reserve_mib=1,
                                                            low_headroom_mib=0, min_expert_slots=0, expert_cache="5"))
    runner, m = engine.runner, engine.pack.model
    layer = m.moe_layers[0]
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, m.hidden_size, generator=gen)
    ids = torch.stack([torch.randperm(m.num_experts, generator=gen)[: m.top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, m.top_k, generator=gen)
    routed = ids.unique().tolist()
    for e in routed[1:]:                                      # the first routed expert resident, the rest not
        if (layer, e) in runner.slots:
            runner.unload((layer, e))
    if (layer, routed[0]) not in runner.slots:
        if not runner.pool.free_slots((layer, routed[0])):
            runner.unload(runner.book.coldest()[0])
        runner.load((layer, routed[0]))
    groups = Groups.of(ids, weights)
    resident = [(layer, e) in runner.slots for e in groups.experts]
    assert 0 < sum(resident) < len(resident)
    split = (runner._device_experts(layer, x, groups.subset(resident))
             + runner.handoff.to_device(runner._host_experts(layer, x, groups.subset([not r for r in resident])), x))
    host = runner._host_experts(layer, x, groups)
    # the device part is torch on exact weights (experts/grouped.py), the host rounds activations to 8 bits
    assert float((split - host).norm() / host.norm()) < 0.02


def test_the_device_check_runs_its_checks_on_the_simulated_card(tmp_path):
    """bench/gpu_check.py is what a GPU session runs once: here the same checks on the demo's
    simulated card, without the server's packages, so the script is known to work before a GPU
    is at hand."""
    import json
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    card = tmp_path / "card.json"
    shutil.copy(root / "moefit" / "demo" / "card.json", card)
    before = card.read_text()
    out = tmp_path / "gpu_check.json"
    # the GPU machine's image has no server packages: the check (and the children it runs the
    # checks in, which inherit PYTHONPATH) must run without them
    blocked = "fastapi uvicorn pydantic starlette sse_starlette".split()
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import importlib.abc, sys\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        f"        if name.split('.')[0] in {blocked!r}: raise ImportError('not on the GPU image: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
    probe = subprocess.run([sys.executable, "-c", "import fastapi"], env=env, capture_output=True, text=True)
    assert "not on the GPU image" in probe.stderr                       # the block is in force
    run = subprocess.run([sys.executable, str(root / "bench" / "gpu_check.py"), "--device", f"sim:{card}", "--quick",
                          "--out", str(out)], capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    checks = json.loads(out.read_text())["checks"]
    assert {k: v["ok"] for k, v in checks.items()} == {"env": None, "greedy": True, "cache": True, "syncs": True,
                                                         "ledger": True, "auto": True, "guard": True, "prompt": None,
                                                         "oom": True, "graphs": True, "kernels": None, "decode": None,
                                                         "launches": None}
    assert checks["syncs"]["handoffs_per_moe_layer_token"] == 1.0
    assert checks["graphs"]["fp32"]["recorder"] == "tape" and checks["graphs"]["fp32"]["replays"] > 0
    assert checks["graphs"]["rings"]["ok"] and checks["graphs"]["rings"]["replays"] > 0    # gpt-oss's rings
    assert checks["guard"]["driver_saw_mib"] == checks["guard"]["freed_by_pool_mib"] > 0
    assert card.read_text() == before                  # its guard and oom checks wrote a copy, not the card


def test_prefill_misses_go_over_pcie_when_that_is_cheaper_and_the_tokens_do_not_change(packs, card):
    """A fast PCIe (given) admits a prefill chunk's misses into the cache; a slow one or none
    leaves them on the host; the greedy tokens are the same either way."""
    from moefit.config import ServeConfig
    from moefit.runtime.engine import Engine
    from moefit.runtime.report import cache_json
    from moefit.runtime.sampler import SamplingParams
    path = card(64)
    prompt = [5, 17, 42, 99, 7, 3, 150, 220, 31, 64, 12, 8, 77, 19, 23, 101]
    runs = {}
    for gbps in (None, 0.000001, 1000.0):
        engine = Engine.open(packs("qwen3_moe", "int8"), ServeConfig(
            device=f"sim:{path}", ctx=64, vram_reserve_mib=1, low_headroom_mib=0, min_expert_slots=0,
            expert_cache="4", prefetch_per_layer=0, pcie_gbps=gbps, host_expert_gbps=1.0))
        engine.generate(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
        runs[gbps] = (list(engine.last.generated), engine.runner.pcie_loads, cache_json(engine))
    assert runs[None][0] == runs[0.000001][0] == runs[1000.0][0]
    assert runs[None][1] == runs[0.000001][1] == 0 and runs[1000.0][1] > 0
    assert runs[1000.0][2]["pcie_gbps"] == 1000.0 and runs[None][2]["pcie_gbps"] == 0.0
    assert runs[1000.0][2]["slots"] == 4                                  # admitted in place of cold ones


def test_a_one_token_routing_groups_as_the_general_path_does():
    """A decode step's routing is grouped in Python (experts/groups.py); it must equal the
    tensor path a multi-token step takes."""
    from moefit.experts.groups import Groups
    gen = torch.Generator().manual_seed(4)
    ids = torch.randperm(64, generator=gen)[:8][None]                     # [1, k] distinct, unsorted
    weights = torch.rand(1, 8, generator=gen)
    fast = Groups.of(ids, weights)
    both = Groups.of(torch.cat([ids, ids]), torch.cat([weights, weights]))   # the general path, two tokens
    assert fast.experts == both.experts == sorted(ids[0].tolist()) and fast.start == list(range(9))
    assert torch.equal(fast.weights, both.weights[0::2]) and torch.equal(fast.rows, both.rows[0::2])
    from array import array
    from moefit.experts.host_side import _grouped                           # a step posted from arrays, regrouped
    for w in (weights, array("f", weights[0].tolist())):
        again = _grouped(ids[0].tolist(), w)
        assert again.experts == fast.experts and torch.equal(again.weights, fast.weights)


@pytest.mark.parametrize("tokens", [1, 5])
def test_a_subset_of_the_groups_is_each_kept_experts_rows_and_weights(tokens):
    """Groups.subset (a step's resident experts, its misses) keeps each kept expert's own rows and
    weights, in order, a decode step's (from its floats) as a multi-token step's (one index)."""
    from moefit.experts.groups import Groups
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(16, generator=gen)[:4] for _ in range(tokens)])
    groups = Groups.of(ids, torch.rand(tokens, 4, generator=gen))
    for keep in ([i % 2 == 0 for i in range(len(groups.experts))], [True] * len(groups.experts),
                 [False] * len(groups.experts)):
        part = groups.subset(keep)
        kept = [i for i, k in enumerate(keep) if k]
        assert part.experts == [groups.experts[i] for i in kept] and len(part.start) == len(kept) + 1
        for j, i in enumerate(kept):
            rows, w = part.rows_of(j)
            want_rows, want_w = groups.rows_of(i)
            assert torch.equal(rows, want_rows) and torch.equal(w, want_w)
        assert part.rows.dtype == groups.rows.dtype and part.weights.dtype == torch.float32


def test_the_pcie_or_host_choice_costs_a_busy_expert_as_the_gemm_it_would_run(packs, card, monkeypatch):
    """A prompt chunk's busy experts would run on the host as fp32 GEMMs (experts/groups.py): the
    choice costs them with the GEMM path's own rates, measured at start next to the dots'."""
    from moefit.config import ServeConfig
    from moefit.experts.costs import MissCosts
    from moefit.pack import quant as dense
    from moefit.runtime.engine import Engine
    from moefit.runtime.report import cache_json
    costs = MissCosts(pcie_bytes_per_s=2e9, host_bytes_per_s=1e9, host_macs_per_s=1e10,
                      gemm_bytes_per_s=5e9, gemm_macs_per_s=1e12)
    assert costs.copy_is_cheaper(10 << 20, 64, 10 ** 7)                  # dots: 74 ms on the host, 5 ms copied
    assert not costs.copy_is_cheaper(10 << 20, 64, 10 ** 7, gemm=True)  # GEMMs: 2.7 ms on the host
    engine = Engine.open(packs("qwen3_moe", "int8"), ServeConfig(
        device=f"sim:{card(64)}", ctx=160, vram_reserve_mib=1, low_headroom_mib=0, min_expert_slots=0,
        expert_cache="4", prefetch_per_layer=0, pcie_gbps=1.0))
    reported = cache_json(engine)
    assert reported["host_gemm_gbps"] > 0 and reported["host_gemm_gmacs"] > 0
    flags = []
    real = engine.runner.costs.copy_is_cheaper
    monkeypatch.setattr(engine.runner.costs, "copy_is_cheaper", lambda *a: flags.append(a[-1]) or real(*a))
    engine.runner.rates.setting = "8"
    engine.prefill([(7 * i) % 300 + 3 for i in range(dense.GEMM_TOKENS + 4)])
    assert True in flags
    flags.clear()
    engine.kv_tokens = []
    engine.prefill([5, 17, 42, 99, 7, 3])                                # a short chunk: the dots' rates
    assert flags and True not in flags


def test_the_host_kernels_never_get_a_device_slot(packs):
    """On CUDA a resident expert's slot is device memory: the host's kernels (the start's host
    measurements, the prompt's GEMM crossover, a miss) take the pack's map instead. Device slots
    are stood in for by meta tensors (no data) on a cpu engine."""
    import threading

    import torch
    from moefit.config import ServeConfig
    from moefit import kernels
    from moefit.runtime.engine import Engine
    engine = Engine.open(packs("qwen3_moe", "int4"), ServeConfig(ctx=64))
    runner, layer = engine.runner, engine.pack.model.moe_layers[0]
    host = {e: runner._on_host(layer, e) for e in range(engine.pack.model.num_experts)}
    done = threading.Event()
    runner.staging().call(done.set)                    # the host panels' copies, made on the worker
    assert done.wait(30)
    host = {e: runner._on_host(layer, e) for e in range(engine.pack.model.num_experts)}
    from moefit.pack.quant import LazyViews
    runner.slots.update({(layer, e): LazyViews(torch.empty(runner.pack.blobs[(layer, e)].nbytes, dtype=torch.uint8,
                                                           device="meta"), runner.pack.layouts[runner.pack.blobs[(layer, e)].quant])
                         for e in host})
    assert all(runner._on_host(layer, e)[0] is host[e][0] for e in host)
    if kernels.library() is None:
        pytest.skip("the native kernel is not built")
    assert runner._pointers(layer, [0, 1]) == [a for e in (0, 1) for a in kernels.addresses(host[e][0], host[e][1] == "int4p")]
    assert min(runner.rates.measure()) > 0 and runner.rates.time_experts(layer, 16, True) > 0


def test_auto_with_room_for_every_expert_caches_every_expert(packs, card):
    """--expert-cache auto budgets every expert as the pool allocates it: a slot is its blob
    rounded up to the alignment, so the blobs' own sum held one expert fewer (15 of 16 here)."""
    from moefit.config import ServeConfig
    from moefit.runtime.engine import Engine
    engine = Engine.open(packs("qwen3_moe", "int4"), ServeConfig(
        device=f"sim:{card(64)}", ctx=64, vram_reserve_mib=1, low_headroom_mib=0, min_expert_slots=0,
        expert_cache="auto"))
    total = len(engine.pack.model_blobs)
    assert engine.plan.slots == len(engine.runner.slots) == total
    assert engine.runner.pool.allocated == engine.plan.line("expert cache").bytes

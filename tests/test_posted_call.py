"""The MoE layer's native call posted to the kernel pool (kernels/layer_call.py, posted.h): the
same bits as the call waited for at once, whatever the engine thread does before it waits; and
the runner doing a layer's bookkeeping while its call is in flight (experts/host_side.py)."""

from __future__ import annotations

import weakref
from array import array

import pytest
import torch

from moefit import kernels
from moefit.kernels import layer_call
from moefit.pack.quant import quantize
from test_kernels import make

pytestmark = pytest.mark.skipif(kernels.library() is None, reason="the native kernels are not built")


@pytest.mark.parametrize("threads", [1, 2])
def test_a_posted_call_gives_the_bits_of_a_waited_one_with_other_native_work_between(threads):
    """While a call is posted, the engine thread's own pooled call (a dense matrix) first finishes
    it; a second call posted joins the first; each result is bit for bit the one of its own."""
    kernels.set_threads(threads)
    try:
        a, b = make("int4", 160, 224, 5, 3, seed=1), make("q8_0", 96, 64, 3, 8, seed=2)
        alone_a, alone_b = kernels.moe_layer(*a[:1], "int4", *a[1:]), kernels.moe_layer(*b[:1], "q8_0", *b[1:])
        g = torch.Generator().manual_seed(3)
        parts = dict(zip(["w", "w.scale"], quantize(torch.randn(70, 64, generator=g), "int8", 32)))
        x = torch.randn(4, 64, generator=g)
        dense_alone = kernels.qlinear(x, parts, "w", "int8")

        first = layer_call.post_views(*a[:1], "int4", *a[1:])
        dense = kernels.qlinear(x, parts, "w", "int8")                 # the pool is the posted call's first
        second = layer_call.post_views(*b[:1], "q8_0", *b[1:])          # joins the first, keeping its result
        assert torch.equal(dense, dense_alone)
        assert torch.equal(second.result(), alone_b) and torch.equal(first.result(), alone_a)
        assert first.result() is first.result()                        # waited for once
    finally:
        kernels.set_threads(kernels.default_threads())


def test_a_posted_call_holds_what_it_reads_until_it_is_joined():
    """A caller that drops the call unjoined (it raised before waiting) frees nothing the pool
    still reads: the call posted last holds its inputs until it is joined, then lets them go."""
    x, experts, rows, weights = make("int8", 544, 768, 4, 8, seed=4)
    want = kernels.moe_layer(x, "int8", experts, rows, weights)
    mine = x.clone()
    alive = weakref.ref(mine)
    layer_call.post_views(mine, "int8", experts, rows, weights)     # the handle dropped at once
    del mine
    assert alive() is not None
    assert torch.equal(layer_call._last.result(), want) and alive() is None


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("quant", ["int8", "int4", "q8_0", "q4_k/q6_k"])
def test_a_step_posted_from_its_routing_gives_the_bits_of_the_grouped_call(quant, threads):
    """moe_step_post: a token's experts in the router's order, their parts read from the layer's
    row of addresses, sorted there; the same bits as moe_post given them grouped (ascending)."""
    kernels.set_threads(threads)
    try:
        x, experts, _, _ = make(quant, 512, 256, 12, 1, seed=5)
        ids, weights = [9, 2, 11, 0, 5, 7], [0.3, 0.05, 0.2, 0.1, 0.25, 0.1]
        table = array("q", [a for p in experts for a in kernels.addresses(p)])
        shape = (256, kernels.group_of(quant.split("/")[0], 512, experts[0].get("gate_up.scale")))
        got = layer_call.step_post(x, quant, shape, table, array("q", ids), array("f", weights)).result()
        order = sorted(range(len(ids)), key=ids.__getitem__)
        want = layer_call.post_views(x, quant, [experts[ids[i]] for i in order], [torch.tensor([0])] * len(ids),
                                     [torch.tensor([weights[i]]) for i in order]).result()
        assert torch.equal(got, want)
        from_tensors = layer_call.step_post(x, quant, shape, table, torch.tensor([ids]), torch.tensor([weights])).result()
        assert torch.equal(from_tensors, want)
        unsorted = layer_call.post_views(x, quant, [experts[e] for e in ids], [torch.tensor([0])] * len(ids),
                                         [torch.tensor([w]) for w in weights]).result()
        assert not torch.equal(got, unsorted)               # the order is the sum's: the test can see it
    finally:
        kernels.set_threads(kernels.default_threads())


@pytest.mark.parametrize("quant", ["int4", "mxfp4"])
def test_a_step_with_gpt_oss_activation_gives_the_bits_of_the_grouped_call(quant):
    """moe_step_post with a layer's step_act (gpt-oss's clamped gate and its bias tables): each
    chosen expert's bias rows read from the tables as its parts are from the row; the same bits
    as moe_post given them grouped with their bias addresses (GptOssAct), which the torch path checks."""
    x, experts, _, _ = make(quant, 512, 256, 12, 1, seed=7)
    x = 3 * x                                                             # large enough to reach the clamps
    g = torch.Generator().manual_seed(8)
    act = kernels.StepAct(1.702, 7.0, torch.randn(12, 512, generator=g), torch.randn(12, 512, generator=g))
    ids, weights = [9, 2, 11, 0], [0.4, 0.1, 0.3, 0.2]
    table = array("q", [a for p in experts for a in kernels.addresses(p)])
    shape = (256, kernels.group_of(quant, 512, experts[0].get("gate_up.scale")))
    got = layer_call.step_post(x, quant, shape, table, array("q", ids), array("f", weights), act).result()
    order = sorted(range(len(ids)), key=ids.__getitem__)
    chosen = [ids[i] for i in order]
    want = layer_call.moe_post(x, quant, shape, [a for e in chosen for a in kernels.addresses(experts[e])],
                               list(range(len(ids) + 1)), torch.zeros(len(ids), dtype=torch.int32),
                               torch.tensor([weights[i] for i in order]), act.of(chosen)).result()
    assert torch.equal(got, want)
    plain = layer_call.step_post(x, quant, shape, table, array("q", ids), array("f", weights)).result()
    assert not torch.equal(got, plain)                                    # the activation is the call's


def test_a_step_of_more_experts_than_it_holds_is_refused():
    x, experts, _, _ = make("int8", 64, 64, 1, 1, seed=6)
    table = array("q", kernels.addresses(experts[0]))
    too_many = kernels.STEP_MOST + 1
    call = layer_call.step_post(x, "int8", (64, 0), table, array("q", [0] * too_many), array("f", [1.0] * too_many))
    assert call.result() is None


def test_the_runner_does_a_layers_bookkeeping_while_its_host_call_is_in_flight(packs, card):
    """On a simulated card with look-ahead (so every step prefetches), each decode layer's
    profile, cache counts and prefetch run after its call was posted and before it is joined;
    the greedy tokens are those of the experts computed call by call, waited for at once."""
    from moefit.config import ServeConfig
    from moefit.experts import host_side
    from moefit.runtime.engine import Engine
    from moefit.runtime.sampler import SamplingParams
    params, prompt = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True), [5, 17, 42, 99, 7, 3]

    def engine():
        return Engine.open(packs("qwen3_moe", "int8"), ServeConfig(
            device=f"sim:{card(64)}", ctx=64, vram_reserve_mib=1, low_headroom_mib=0, min_expert_slots=0,
            expert_cache="4", prefetch_per_layer=2))
    e = engine()
    seen, landed, tokens = [], [], []
    record, arrived, run = e.runner.book.record, e.runner._arrived, e.runner.run

    def in_flight() -> bool:
        return layer_call._last is not None and layer_call._last._rc is None

    def record_in_flight(*args):
        seen.append(in_flight())
        return record(*args)

    def arrived_in_flight(*args):
        if args:                                                        # a layer's (settle's are all layers')
            landed.append((tokens[-1], in_flight()))
        return arrived(*args)

    def run_counted(layer, x, *args):
        tokens.append(x.shape[0])
        return run(layer, x, *args)
    e.runner.book.record, e.runner._arrived, e.runner.run = record_in_flight, arrived_in_flight, run_counted
    posted = e.generate(prompt, params)[1].generated
    assert len(seen) == 20 and all(seen), seen                          # 10 forwards x 2 MoE layers
    step_landings = [flying for t, flying in landed if t == 1]          # a decode step's call goes first
    assert step_landings and all(step_landings), landed

    start, step = host_side.start, host_side.step
    host_side.start = lambda *a, **k: host_side.HostWork(*a[:4], [], out=start(*a, **k).result())
    host_side.step = lambda *a, **k: None                               # each step grouped first, as before
    try:
        at_once = engine().generate(prompt, params)[1].generated
    finally:
        host_side.start, host_side.step = start, step
    assert posted == at_once


def test_a_decode_step_on_host_memory_is_posted_before_its_routing_is_grouped(packs):
    """--device cpu: each decode layer's call is posted with its routing (route_post: Qwen3-MoE's
    softmax router and the post in one call; step_post where an expert's parts were not yet in
    the layer's row, and the call only routed) before Groups.of runs, and is still in flight then;
    the prompt's layers go through moe_post."""
    from moefit.config import ServeConfig
    from moefit.experts import groups, runner
    from moefit.runtime.engine import Engine
    from moefit.runtime.sampler import SamplingParams
    e = Engine.open(packs("qwen3_moe", "int8"), ServeConfig(ctx=64))
    calls, grouped = [], []
    step_post, route_post, of = kernels.step_post, kernels.route_post, groups.Groups.of

    def step_spy(*a):
        calls.append("step")
        return step_post(*a)

    def route_spy(*a):
        routed = route_post(*a)
        calls.append("route" if routed[0] is not None else "routed")
        return routed

    def of_spy(ids, *a):
        if ids.shape[0] == 1:
            grouped.append(layer_call._last is not None and layer_call._last._rc is None)
        return of(ids, *a)
    kernels.step_post, kernels.route_post, runner.Groups.of = step_spy, route_spy, of_spy
    try:
        e.generate([5, 17, 42, 99, 7, 3], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    finally:
        kernels.step_post, kernels.route_post, runner.Groups.of = step_post, route_post, of
    posts = [c for c in calls if c != "routed"]
    assert len(calls) == 8 + posts.count("step") and grouped == [True] * 8, (calls, grouped)  # 4 forwards x 2 layers
    assert all(a == "routed" for a, b in zip(calls, calls[1:]) if b == "step")                 # step_post only then
    assert "route" in posts


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "olmoe", "qwen3_5_moe", "glm4_moe", "deepseek_v3",
                                    "gpt_oss"])
def test_a_natively_routed_step_gives_the_routers_numbers(packs, family):
    """A family whose router is one of the native ones (native_router: a softmax top-k; GLM's and
    DeepSeek's grouped sigmoid) routes a decode step on host memory in the native call that posts
    its experts (a shared expert posted before it, with the dense matrices quantised): the same
    greedy tokens and last hidden state, bit for bit, as the family's own route followed by the
    runner's post."""
    from moefit.config import ServeConfig
    from moefit.models.layers import DecoderModel
    from moefit.runtime.engine import Engine
    from moefit.runtime.sampler import SamplingParams
    params, prompt = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), [5, 17, 42, 99, 7, 3]
    e = Engine.open(packs(family, "int8"), ServeConfig(ctx=64, dense_quant="int8"))
    posted, route_post = [], kernels.route_post
    kernels.route_post = lambda *a: posted.append(route_post(*a)) or posted[-1]
    try:
        tokens = e.generate(prompt, params)[1].generated
        hidden = e.last_hidden.clone()
    finally:
        kernels.route_post = route_post
    assert any(r[0] is not None for r in posted)
    own = type(e.model).native_router
    type(e.model).native_router = DecoderModel.native_router                   # None: the family routes
    try:
        e.kv_tokens = []
        assert e.generate(prompt, params)[1].generated == tokens
        assert torch.equal(e.last_hidden, hidden)
    finally:
        type(e.model).native_router = own


@pytest.mark.parametrize("family", ["qwen3_5_moe", "glm4_moe"])
def test_a_decode_steps_shared_expert_is_posted_beside_the_routed_experts(packs, family):
    """With the dense matrices quantised, a decode step's shared expert is one native call: it is
    posted after the router and joined by the routed experts' post; the greedy tokens and the
    last hidden state are those of it computed at once."""
    from moefit.config import ServeConfig
    from moefit.models import layers
    from moefit.runtime.engine import Engine
    from moefit.runtime.sampler import SamplingParams
    params, prompt = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), [5, 17, 42, 99, 7, 3]
    e = Engine.open(packs(family, "int8"), ServeConfig(ctx=64, dense_quant="int8"))
    posts, post = [], kernels.swiglu_post

    def counted(*a):
        posts.append(a[0].shape[0])
        return post(*a)
    kernels.swiglu_post = counted
    try:
        posted = e.generate(prompt, params)[1].generated
        posted_hidden = e.last_hidden.clone()
    finally:
        kernels.swiglu_post = post
    assert set(posts) == {6, 1}, posts                            # the 6-token prompt (below a GEMM's) and each step
    later = layers.swiglu_later
    layers.swiglu_later = lambda x, gu, dn: (lambda y=layers.swiglu(x, gu, dn): y)
    try:
        e.kv_tokens = []
        assert e.generate(prompt, params)[1].generated == posted
        assert torch.equal(e.last_hidden, posted_hidden)
    finally:
        layers.swiglu_later = later

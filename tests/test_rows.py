"""The native row operations (kernels/rows.h) against torch in float64: RMSNorm of plain and
strided rows, QK-norm + RoPE of a projection's heads (full and partial rotation), one position's
grouped-query attention over a cache view of 1 to 5,000 keys (kernels/kv.h's, through
moe_attend_one; every KV dtype in tests/test_kv_attention.py), a softmax router's top-k; every
instruction set."""

import pytest
import torch

from moefit import kernels
from moefit.kernels import rows
from moefit.models.rope import RopeTable, apply_partial_rope
from narrow_isa import NARROWER, check_under

pytestmark = pytest.mark.skipif(kernels.library() is None, reason="the native kernel is not built")
TOL = 2e-6


def close(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max())


def rms_reference(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    x = x.double()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y * w.double() if w is not None else y


@pytest.mark.parametrize("shape", [(1, 2048), (7, 64), (3, 4, 128)])
@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm_of_rows(shape, weighted):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g) * 3
    w = torch.randn(shape[-1], generator=g) if weighted else None
    assert close(rows.rms_norm(x, w, 1e-6), rms_reference(x, w, 1e-6)) < TOL


def test_rms_norm_of_strided_rows_reads_only_the_view():
    wide = torch.randn(5, 96)
    view = wide[:, 16:80]                              # rows 96 apart, 64 wide
    assert close(rows.rms_norm(view, None, 1e-5), rms_reference(view, None, 1e-5)) < TOL


def test_shapes_it_does_not_take_are_left_to_torch():
    assert rows.rms_norm(torch.randn(2, 40), None, 1e-6) is None             # not a multiple of 16
    assert rows.rms_norm(torch.randn(2, 64).double(), None, 1e-6) is None
    assert rows.rms_norm(torch.randn(64, 2).T, None, 1e-6) is None          # columns strided
    assert rows.attend_one(torch.randn(8, 2, 64), torch.randn(2, 9, 64), torch.randn(2, 9, 64), None) is None
    assert rows.attend_one(torch.randn(128, 1, 64), torch.randn(1, 9, 64), torch.randn(1, 9, 64), None) is None  # MLA's 128 a head


@pytest.mark.parametrize("rot", [128, 64])
@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("gated", [False, True])
def test_heads_normed_and_rotated(rot, tokens, gated):
    """Heads read where the projection holds them: q of a fused q, k, v (token rows strided), or
    Qwen3.5's per-head [query | gate] (heads strided too)."""
    g = torch.Generator().manual_seed(rot + tokens)
    h, k, d = 8, 2, 128
    qkv = torch.randn(tokens, (2 * h + 2 * k) * d, generator=g)
    q = qkv[:, :2 * h * d].view(tokens, h, 2 * d).chunk(2, -1)[0] if gated else qkv[:, :h * d].view(tokens, h, d)
    w = torch.randn(d, generator=g)
    cos, sin = RopeTable({"rope_theta": 1e6}, rot, 4096, "cpu", torch.float32).rows(37, tokens)
    want = apply_partial_rope(rms_reference(q, w, 1e-6).float().transpose(0, 1), cos, sin)
    got = rows.head_rows(q, w, 1e-6, cos, sin)
    assert got.shape == (h, tokens, d) and close(got, want.double()) < 1e-5
    assert torch.equal(rows.head_rows(q, None, 0.0, None, None), q.transpose(0, 1))    # neither: a copy
    rotated = rows.head_rows(q, None, 0.0, cos, sin)                                  # RoPE alone
    assert close(rotated, apply_partial_rope(q.transpose(0, 1), cos, sin).double()) < 1e-6


@pytest.mark.parametrize("keys", [1, 31, 33, 200, 5000])
@pytest.mark.parametrize("heads,kv_heads,d,dv", [(32, 4, 128, 128), (8, 8, 64, 64), (16, 2, 256, 128)])
def test_one_position_attends_like_softmax(keys, heads, kv_heads, d, dv):
    g = torch.Generator().manual_seed(keys + heads)
    q = torch.randn(heads, 1, d, generator=g)
    cache_k = torch.randn(kv_heads, keys + 11, d, generator=g) * 2       # the cache holds more rows
    cache_v = torch.randn(kv_heads, keys + 11, dv, generator=g)
    k, v = cache_k[:, :keys], cache_v[:, :keys]
    scale = 0.7 / d ** 0.5
    kk = k.double().repeat_interleave(heads // kv_heads, 0)
    vv = v.double().repeat_interleave(heads // kv_heads, 0)
    want = torch.softmax(q.double() @ kk.transpose(1, 2) * scale, -1) @ vv
    assert close(rows.attend_one(q, k, v, scale), want) < 1e-5             # fp32 sums of up to 5,000 terms


@pytest.mark.parametrize("tokens,experts,k", [(1, 128, 8), (5, 64, 8), (3, 8, 2), (2, 40, 40)])
@pytest.mark.parametrize("renorm", [True, False])
def test_a_softmax_router_picks_and_weighs_like_torch(tokens, experts, k, renorm):
    g = torch.Generator().manual_seed(tokens * experts + k)
    x, w = torch.randn(tokens, 256, generator=g), torch.randn(experts, 256, generator=g) * 0.1
    weights, ids = rows.softmax_topk(x, w, k, renorm)
    probs = torch.softmax(x.double() @ w.double().T, -1)
    want_w, want_ids = torch.topk(probs, k, dim=-1)
    assert torch.equal(ids, want_ids)                                  # largest first
    if renorm:
        want_w = want_w / want_w.sum(-1, keepdim=True)
    assert close(weights, want_w) < 1e-5


def test_a_biased_router_renormalised_is_gpt_oss_softmax_of_its_top_k_logits():
    g = torch.Generator().manual_seed(4)
    x, w, bias = torch.randn(3, 256, generator=g), torch.randn(32, 256, generator=g) * 0.1, torch.randn(32, generator=g)
    weights, ids = rows.softmax_topk(x, w, 4, True, bias)
    top, want_ids = torch.topk(x.double() @ w.double().T + bias.double(), 4, dim=-1)
    assert torch.equal(ids, want_ids) and close(weights, torch.softmax(top, -1)) < 1e-5


def test_a_router_tie_goes_to_the_lower_expert():
    x, w = torch.ones(1, 16), torch.zeros(6, 16)
    w[4] = w[2] = 0.5                                                   # experts 2 and 4 tie, first
    weights, ids = rows.softmax_topk(x, w, 3, renorm=False)
    assert ids.tolist() == [[2, 4, 0]] and weights[0, 0] == weights[0, 1]


@pytest.mark.parametrize("tokens,experts,k,groups,top_groups", [(1, 64, 4, 1, 1), (3, 256, 8, 8, 4), (2, 64, 6, 4, 2),
                                                               (4, 16, 16, 2, 2)])
@pytest.mark.parametrize("normalise", [True, False])
def test_a_sigmoid_router_picks_and_weighs_like_torch(tokens, experts, k, groups, top_groups, normalise):
    """DeepSeek-V3's router, GLM's with one group: the experts torch's sigmoid_group_topk picks, in
    its order, and their weights."""
    from moefit.models.layers import sigmoid_group_topk
    g = torch.Generator().manual_seed(tokens * experts + k)
    x, w = torch.randn(tokens, 256, generator=g), torch.randn(experts, 256, generator=g) * 0.1
    bias = torch.randn(experts, generator=g) * 0.3
    weights, ids = rows.sigmoid_topk(x, w, bias, k, groups, top_groups, normalise, 2.5)
    want_w, want_ids = sigmoid_group_topk(x.double() @ w.double().T, bias, k, groups, top_groups, normalise, 2.5)
    assert torch.equal(ids, want_ids)
    assert close(weights, want_w) < 1e-5
    if top_groups < groups:                                      # every pick from a kept group
        assert all(len(set(row)) <= top_groups for row in (ids // (experts // groups)).tolist())


@pytest.mark.parametrize("quant", ["int8", "int4"])
@pytest.mark.parametrize("tokens", [1, 3])
def test_a_swiglu_in_one_call_equals_it_op_by_op(quant, tokens, monkeypatch):
    """A shared expert's or a dense layer's MLP through two quantised matrices (--dense-quant): one
    native call (kernels/linear.h) against the two products and torch's silu between them."""
    import torch.nn.functional as F
    from moefit.models.layers import Weights, linear, swiglu
    g = torch.Generator().manual_seed(7)
    mats = {"gu.weight": torch.randn(2 * 96, 128, generator=g) * 0.1,
            "down.weight": torch.randn(128, 96, generator=g) * 0.1}
    w = Weights(list(mats), mats.__getitem__, lambda name, t, keep=False: t, dense_quant=quant)
    gate_up, down = w.get("gu.weight"), w.get("down.weight")
    x = torch.randn(tokens, 128, generator=g)
    gate, up = linear(x, gate_up).chunk(2, dim=-1)
    want = linear(F.silu(gate) * up, down)
    calls, real = [], kernels.swiglu
    monkeypatch.setattr(kernels, "swiglu", lambda *a: calls.append(real(*a)) or calls[-1])
    assert close(swiglu(x, gate_up, down), want) < 1e-5
    assert len(calls) == 1 and calls[0] is not None                   # layers.swiglu took the one call


@pytest.mark.parametrize("quant", ["int8", "int4"])
@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("threads", [1, 3])
def test_each_head_through_its_own_matrix(quant, tokens, threads):
    """MLA's per-head products (kernels.linear_heads): H matrices stacked and quantised, head h's
    rows against head h's activations only, as each head's own product gives them, bit for bit;
    a head a task (1 thread) or a head's rows split (3 threads, 4 heads)."""
    from moefit.models.layers import Weights
    g = torch.Generator().manual_seed(tokens)
    heads, rows_, cols = 4, 48, 96
    mats = {"w.weight": torch.randn(heads * rows_, cols, generator=g) * 0.1}
    w = Weights(list(mats), mats.__getitem__, lambda name, t, keep=False: t, dense_quant=quant).get("w.weight")
    x = torch.randn(heads, tokens, cols, generator=g)
    every = torch.stack([w(x[h]) for h in range(heads)])                  # each head's rows through every matrix
    want = torch.stack([every[h, :, h * rows_:(h + 1) * rows_] for h in range(heads)])
    kernels.set_threads(threads)
    try:
        assert torch.equal(kernels.linear_heads(x, w.step, heads), want)
    finally:
        kernels.set_threads(kernels.default_threads())


def test_attention_does_not_depend_on_the_thread_count():
    q, k, v = torch.randn(32, 1, 128), torch.randn(4, 1300, 128), torch.randn(4, 1300, 128)   # three key ranges
    outs = []
    for n in (1, 2):
        kernels.set_threads(n)
        outs.append(rows.attend_one(q, k, v, None))
    kernels.set_threads(kernels.default_threads())
    assert torch.equal(*outs)


def check_every_op() -> str:
    """The tests above in one process (the narrower instruction sets run it)."""
    for shape in [(1, 2048), (3, 4, 128)]:
        test_rms_norm_of_rows(shape, True)
    test_heads_normed_and_rotated(64, 5, True)
    for keys in (1, 33, 200):
        test_one_position_attends_like_softmax(keys, 32, 4, 128, 128)
    test_a_softmax_router_picks_and_weighs_like_torch(5, 64, 8, True)
    test_a_sigmoid_router_picks_and_weighs_like_torch(3, 256, 8, 8, 4, True)
    return kernels.isa()


@pytest.mark.parametrize("isa", NARROWER)
def test_the_narrower_instruction_sets_compute_the_same(isa):
    check_under(isa, "test_rows", "check_every_op")


def test_a_decode_step_uses_them_and_torch_gives_the_same_logits(tmp_path, monkeypatch):
    """A decode step computes each op natively (else the speed-up is gone without a test failing:
    a call that returns None counts for nothing), and its logits equal those with the ops left to
    torch. Head dim 32 (the kernel takes multiples of 16), qkv unquantised (so the one-call step
    of tests/test_step.py does not take the layer)."""
    import tiny
    from moefit.config import ServeConfig
    from moefit.models import layers
    from moefit.pack.convert import convert
    from moefit.runtime.engine import Engine
    convert(tiny.build_checkpoint("qwen3_moe", tmp_path / "hf", head_dim=32), tmp_path / "pack", "int8", progress=False)
    prompt = list(range(3, 40))
    engine = Engine.open(tmp_path / "pack", ServeConfig(ctx=128, dense_quant="off"))
    computed = {"rms_norm": 0, "head_rows": 0, "attend_stored": 0, "softmax_topk": 0}
    for name in computed:
        def counted(*a, _real=getattr(rows, name), _name=name):
            out = _real(*a)
            computed[_name] += out is not None
            return out
        monkeypatch.setattr(layers.native, name, counted)
    engine.prefill(prompt)
    native = engine.decode_step(7, len(prompt))
    assert all(computed.values()), computed
    for name in computed:
        monkeypatch.setattr(layers.native, name, lambda *a: None)
    engine.kv_tokens = []
    engine.prefill(prompt)
    assert close(native, engine.decode_step(7, len(prompt)).double()) < 1e-5

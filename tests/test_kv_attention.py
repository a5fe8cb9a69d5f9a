"""Attention over KV rows as they are stored (kernels/kv.h): every KV dtype against float64
softmax over the same decoded rows, output and log-sum-exp; key ranges and query-row passes
merged exactly; the same sums whatever the thread count; attend_state reads a plain cache and
KV streaming's host part through it, with the same numbers as decoding them for torch; every
instruction set."""

from types import SimpleNamespace

import pytest
import torch

from moefit import kernels
from moefit.families.state import AttentionKV
from moefit.kernels import rows
from moefit.memory.devices import open_device
from moefit.models.attention import attend_state
from moefit.runtime.kv_codecs import StoredRows, codec
from moefit.runtime.placement import DeviceMemory
from moefit.runtime.state import AttentionState, SequenceState
from narrow_isa import NARROWER, check_under

pytestmark = pytest.mark.skipif(kernels.library() is None, reason="the native kernel is not built")
KV_DTYPES = ["fp32", "fp16", "bf16", "int8", "q4"]


def stored(kv_dtype: str, heads: int, keys: int, d: int, capacity: int, g: torch.Generator) -> StoredRows:
    c = codec(kv_dtype, d)
    store = c.empty(lambda shape, dtype: torch.zeros(shape, dtype=dtype), heads, capacity)
    c.put(store, slice(0, keys), torch.randn(heads, keys, d, generator=g) * 2)
    return StoredRows(c, store, keys)


def reference(q: torch.Tensor, k: StoredRows, v: StoredRows, scale: float):
    scores = q.double() @ k.decode(torch.float64).transpose(1, 2) * scale
    return torch.softmax(scores, -1) @ v.decode(torch.float64), torch.logsumexp(scores, -1, keepdim=True)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("kv_heads,q_rows,keys,d,dv", [
    (4, 8, 1, 128, 128),          # a first decode step
    (2, 5, 37, 64, 64),           # a partial block of keys, an odd number of rows
    (1, 17, 1500, 128, 96),       # three key ranges (512 each), the last partial; dv != d
    (1, 70, 600, 64, 64),         # two passes of query rows (64 a pass)
])
def test_every_kv_dtype_attends_like_softmax_over_its_decoded_rows(kv_dtype, kv_heads, q_rows, keys, d, dv):
    g = torch.Generator().manual_seed(keys + q_rows)
    k = stored(kv_dtype, kv_heads, keys, d, keys + 9, g)              # the store holds more rows
    v = stored(kv_dtype, kv_heads, keys, dv, keys + 9, g)
    q = torch.randn(kv_heads, q_rows, d, generator=g)
    out, lse = rows.attend_stored(q, k, v, 0.7 / d ** 0.5)
    want, want_lse = reference(q, k, v, 0.7 / d ** 0.5)
    assert out.shape == (kv_heads, q_rows, dv) and lse.shape == (kv_heads, q_rows, 1)
    assert float((out.double() - want).abs().max() / want.abs().max()) < 1e-5
    assert float((lse.double() - want_lse).abs().max()) < 1e-5


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("heads,keys,rank,rope", [(20, 1, 512, 64), (16, 700, 64, 16), (4, 1100, 32, 8)])
def test_mla_attends_in_its_latent_like_softmax_over_latent_and_rope_keys(kv_dtype, heads, keys, rank, rope):
    """moe_attend_latent: each head's [q_c | q_r] against keys [latent | rope key] and values the
    latent, the two stores read as stored, each with its own row scales (int8)."""
    g = torch.Generator().manual_seed(keys + heads)
    k_rope, latent = stored(kv_dtype, 1, keys, rope, keys + 5, g), stored(kv_dtype, 1, keys, rank, keys + 5, g)
    q = torch.randn(1, heads, rank + rope, generator=g)
    out, lse = rows.attend_stored(q, k_rope, latent, 0.3 / rank ** 0.5, latent=True)
    keys = torch.cat((latent.decode(torch.float64), k_rope.decode(torch.float64)), -1)
    scores = q.double() @ keys.transpose(1, 2) * 0.3 / rank ** 0.5
    want = torch.softmax(scores, -1) @ latent.decode(torch.float64)
    assert out.shape == (1, heads, rank)
    assert float((out.double() - want).abs().max() / want.abs().max()) < 1e-5
    assert float((lse.double() - torch.logsumexp(scores, -1, keepdim=True)).abs().max()) < 1e-5


def test_an_mla_decode_step_takes_the_latent_kernel_with_the_numbers_torch_gets(monkeypatch):
    """DeepSeek-V3's attention over a plain host cache: the latent kernel, then with it declined the
    torch route (decode both stores, concatenate the keys, SDPA), to float rounding."""
    from moefit.models import attention
    from moefit.families.state import LatentKV
    g = torch.Generator().manual_seed(3)
    state = SequenceState(SimpleNamespace(sliding_window=None), 40, "int8", torch.float32,
                          DeviceMemory(open_device("cpu")), 32, decls=[LatentKV(64, 16)])
    state.write(0, 0, torch.randn(1, 33, 16, generator=g), torch.randn(1, 33, 64, generator=g))
    q = torch.randn(8, 1, 80, generator=g)
    taken = []
    kernel = rows.attend_stored
    monkeypatch.setattr(rows, "attend_stored", lambda *a, **kw: taken.append(kw) or kernel(*a, **kw))
    got = attention.attend_latent(state, 0, q, 32, 0.2)
    assert taken == [{"latent": True}] and got.shape == (1, 8 * 64)
    want = attend_state(state, 0, q, 32, None, scale=0.2, keys=lambda k_r, c: (torch.cat((c, k_r), -1), c))
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5


def test_stores_it_cannot_read_are_declined():
    g = torch.Generator().manual_seed(1)
    k = stored("int8", 2, 10, 64, 10, g)
    odd = stored("fp32", 2, 10, 20, 10, g)                           # 20 values a row: not a multiple of 8
    assert rows.attend_stored(torch.randn(2, 4, 20), odd, odd, 1.0) is None
    assert rows.attend_stored(torch.randn(2, 4, 64), k, StoredRows(k.codec, k.store, 9), 1.0) is None


def test_the_sums_do_not_depend_on_the_thread_count():
    g = torch.Generator().manual_seed(2)
    k, v = stored("int8", 1, 1300, 128, 1300, g), stored("int8", 1, 1300, 128, 1300, g)
    q = torch.randn(1, 16, 128, generator=g)
    outs = []
    for n in (1, 2, 3):
        kernels.set_threads(n)
        outs.append(rows.attend_stored(q, k, v, 0.1))
    kernels.set_threads(kernels.default_threads())
    assert all(torch.equal(o[0], outs[0][0]) and torch.equal(o[1], outs[0][1]) for o in outs)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES + ["k8v4"])
@pytest.mark.parametrize("resident", [None, 64])
@pytest.mark.parametrize("tokens", [1, 3])
def test_attend_state_reads_stored_rows_natively_with_the_numbers_torch_gets(kv_dtype, resident, tokens, monkeypatch):
    """A plain cache (decode steps; a verify window's keys before it) and KV streaming's host part
    (any forward after the ring's window) go to the kernel as stored; with the kernel declined,
    torch decodes them: the same output to fp32 rounding."""
    g = torch.Generator().manual_seed(3)
    state = SequenceState(SimpleNamespace(sliding_window=None), 700, kv_dtype, torch.float32,
                          DeviceMemory(open_device("cpu")), 32, resident, decls=[AttentionKV(2, 64, 64)])
    for start in range(0, 600, 30):                                            # prefill chunks of 30
        state.write(0, start, torch.randn(2, 30, 64, generator=g), torch.randn(2, 30, 64, generator=g))
    start = 600 - tokens
    q = torch.randn(8, tokens, 64, generator=g)
    mask = None if tokens == 1 else torch.ones(tokens, 600).tril(600 - tokens).bool()
    calls = []
    real = rows.attend_stored
    monkeypatch.setattr(rows, "attend_stored", lambda *a: calls.append(a[1].count) or real(*a))
    native = attend_state(state, 0, q, start, mask)
    monkeypatch.setattr(rows, "attend_stored", lambda *a: None)
    decoded = attend_state(state, 0, q, start, mask)
    if tokens > 1 and kv_dtype == "fp32":
        assert calls == []                                     # torch's flash kernel on the rows themselves
    else:
        assert calls == ([600 - 64] if resident else [600] if tokens == 1 else [600 - tokens])  # a window: the keys before it
    assert float((native - decoded).abs().max() / decoded.abs().max()) < 1e-5


def test_a_ring_keeps_rows_of_a_narrower_dtype():
    """Writing a ring's slots is an index_put, which does not convert: fp32 rows into an fp16 ring
    failed before the codec converted them."""
    layer = AttentionState(AttentionKV(2, 64, 64), 200, "fp16", torch.float32, DeviceMemory(open_device("cpu")), 16, 32)
    k = torch.randn(2, 48, 64)
    for start in (0, 16, 32):
        layer.write(start, k[:, start:start + 16], k[:, start:start + 16])
    ring_k, _, pos = layer.parts(48)[-1]
    held = pos < 48
    assert torch.equal(ring_k[:, held], k[:, pos[held]].half().float())


def check_every_dtype() -> str:
    """The kernel tests above in one process (the narrower instruction sets run it)."""
    for kv_dtype in KV_DTYPES:
        test_every_kv_dtype_attends_like_softmax_over_its_decoded_rows(kv_dtype, 1, 17, 1500, 128, 96)
        test_every_kv_dtype_attends_like_softmax_over_its_decoded_rows(kv_dtype, 2, 5, 37, 64, 64)
    for kv_dtype in ("fp32", "bf16", "int8"):
        test_mla_attends_in_its_latent_like_softmax_over_latent_and_rope_keys(kv_dtype, 16, 700, 64, 16)
    return kernels.isa()


@pytest.mark.parametrize("isa", NARROWER)
def test_the_narrower_instruction_sets_compute_the_same(isa):
    check_under(isa, "test_kv_attention", "check_every_dtype")


@pytest.mark.parametrize("t", [1, 3, 16])
def test_a_few_masked_positions_attend_as_the_expanded_heads_would_without_expanding_them(t):
    """models/attention.sdpa: a verify window's (or a recorded step's bucket's) grouped-query
    attention under a mask as each kv head's query heads x positions in rows, the mask repeated:
    the numbers of the expanded [H, S, D] keys and values, which it no longer copies."""
    import torch.nn.functional as F
    from moefit.models.attention import causal_mask, sdpa
    gen = torch.Generator().manual_seed(t)
    h, kv, s, d = 8, 2, 40, 16
    q, k, v = (torch.randn(*shape, generator=gen) for shape in ((h, t, d), (kv, s, d), (kv, s, d)))
    mask = causal_mask(s - t, t, None, "cpu") if t > 1 else torch.arange(s)[None] <= 30
    want = F.scaled_dot_product_attention(q[None], k.repeat_interleave(h // kv, 0)[None],
                                          v.repeat_interleave(h // kv, 0)[None], attn_mask=mask)[0]
    assert (sdpa(q, k, v, mask, None) - want).abs().max() < 1e-6

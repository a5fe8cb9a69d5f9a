import pytest
import torch

from moefit.pack.layout import blob_nbytes, expert_layout, layer_quants
from moefit.pack.quant import blob_views, dequantize, quantize


@pytest.mark.parametrize("quant,bound", [("int8", 0.01), ("int4", 0.12), ("bf16", 0.005), ("fp16", 0.001)])
def test_round_trip_error_per_matrix(quant, bound):
    w = torch.randn(96, 64, generator=torch.Generator().manual_seed(0))
    names = ["w", "w.scale"]
    parts = dict(zip(names, quantize(w, quant, 32)))
    back = dequantize(parts, "w", quant, torch.float32)
    assert back.shape == w.shape
    assert (back - w).norm() / w.norm() < bound


def test_int4_packs_two_codes_per_byte_low_nibble_first():
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1] = 7.0, -7.0                         # scale = 1 -> codes 15 and 1
    packed, scale = quantize(w, "int4", 32)
    assert packed.shape == (1, 16) and packed[0, 0].item() == 15 | (1 << 4)
    assert float(scale) == 1.0


def test_blob_views_see_the_parts_where_the_layout_puts_them():
    layout = expert_layout(64, 96, "int4", 32)
    blob = torch.zeros(blob_nbytes(layout), dtype=torch.uint8)
    views = blob_views(blob, layout)
    assert views["gate_up"].shape == (192, 32) and views["down.scale"].shape == (64, 3)
    views["down.scale"].fill_(1.0)
    assert blob.sum() > 0                                # a view, not a copy


@pytest.mark.parametrize("quant", ["int4", "int8", "bf16"])
def test_a_slots_part_addresses_are_its_views_without_making_them(quant):
    """The host call's pointers into a slot come from the layout's offsets: the views (~30 us a
    slot, several a layer call) are made only where something reads them."""
    from moefit import kernels
    from moefit.pack.quant import LazyViews
    layout = expert_layout(64, 96, quant, 32)
    blob = torch.zeros(blob_nbytes(layout), dtype=torch.uint8)
    lazy = LazyViews(blob, layout)
    got = kernels.addresses(lazy)
    assert lazy._views is None and ("gate_up.scale" in lazy) == (quant != "bf16") and "nothing" not in lazy
    assert got == kernels.addresses(blob_views(blob, layout)) and got[0] == blob.data_ptr()


def test_mixed_recipe_keeps_edge_layers_at_int8():
    assert layer_quants("mixed", [0, 2, 3, 5]) == {0: "int8", 2: "int4", 3: "int4", 5: "int8"}
    int8 = blob_nbytes(expert_layout(2048, 768, "int8", 32))
    int4 = blob_nbytes(expert_layout(2048, 768, "int4", 32))
    assert int4 < int8 < 2 * int4 + 4096


@pytest.mark.parametrize("quant,group", [("int8", 32), ("int4", 32), ("int4", 128), ("q8_0", 32)])
def test_the_native_dequantisation_is_torchs_bit_for_bit(quant, group):
    from moefit import kernels
    if kernels.library() is None:
        pytest.skip("the native kernel is not built")
    parts = dict(zip(["w", "w.scale"], quantize(torch.randn(70, 256, generator=torch.Generator().manual_seed(1)),
                                                quant, group)))
    assert torch.equal(kernels.dequantize(parts, "w", quant), dequantize(parts, "w", quant, torch.float32))


def hard_weights(rows: int, cols: int, group: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows that probe the rounding: scales from 1e-7 (fp16 subnormal) to 1e3, a zero group, a
    group whose fp16 scale underflows to 0, exact ties of half a step, and plain noise."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(rows, cols, generator=g) * torch.logspace(-7, 3, rows)[:, None]
    w[0, :group] = 0.0                                                   # amax 0: codes of 0 / 0
    w[1, :group] = 1e-9                                                  # a scale of 0 in fp16
    step = 0.25                                                          # a power of two: exact ties
    w[2] = (torch.randint(-6, 6, (cols,), generator=g) + 0.5) * step
    w[2, 0] = 7 * step
    return w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("quant,group", [("int8", 0), ("int4", 32), ("int4", 64), ("q8_0", 32)])
def test_the_native_quantisation_is_torchs_bit_for_bit(quant, group, dtype):
    """kernels.quantize (weights.h: a pack's experts and --dense-quant's matrices at load) gives
    quantize_in_torch's codes and scales exactly, edge cases included."""
    from moefit import kernels
    from moefit.pack.quant import quantize_in_torch
    if kernels.library() is None:
        pytest.skip("the native kernel is not built")
    w = hard_weights(37, 256, group or 32, dtype)
    native, torch_parts = kernels.quantize(w, quant, group), quantize_in_torch(w, quant, group)
    assert native is not None
    for a, b in zip(native, torch_parts):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), quant
    assert kernels.quantize(w[:, :250], "q8_0", 32) is None                 # not whole blocks: torch says why


@pytest.mark.parametrize("quant", ["q4_k", "q5_k", "q6_k", "iq4_xs", "mxfp4"])
def test_the_native_dequantisation_of_gguf_blocks_is_kblocks_bit_for_bit(quant):
    import gguf
    from gguf_writer import super_blocks
    from moefit import kernels
    from moefit.pack.kblocks import dequantize_blocks
    if kernels.library() is None:
        pytest.skip("the native kernel is not built")
    qtype = getattr(gguf.GGMLQuantizationType, quant.upper())
    raw = torch.from_numpy(super_blocks((37, 512), qtype, 5))
    want = dequantize_blocks(raw, quant)
    assert want.shape == (37, 512) and kernels.matrix_shape(raw, quant) == (37, 512)
    assert torch.equal(kernels.dequantize({"w": raw}, "w", quant), want)
    assert torch.equal(torch.from_numpy(gguf.quants.dequantize(raw.numpy(), qtype)).float(), want)   # the oracle


def test_a_busy_expert_of_a_prompt_is_two_gemms_on_its_exact_weights():
    """gemm_forward = the SwiGLU expert on the fp32 weights exactly, its activations rounded as the
    dots round them (the same fp32 GEMMs), so within fp32 rounding of the native dots (with fp32
    activations the two were 1e-2 apart); Groups.busy picks it only in a prompt chunk."""
    import torch.nn.functional as F
    from moefit import kernels
    from moefit.experts.groups import Groups, gemm_forward
    from moefit.pack import quant as q
    if kernels.library() is None:
        pytest.skip("the native kernel is not built")
    g = torch.Generator().manual_seed(3)
    parts = dict(zip(["gate_up", "gate_up.scale"], quantize(torch.randn(128, 256, generator=g) * 0.1, "int4", 32)))
    parts.update(zip(["down", "down.scale"], quantize(torch.randn(256, 64, generator=g) * 0.1, "int4", 32)))
    x = torch.randn(40, 256, generator=g)
    with kernels.torch_threads():
        got = gemm_forward(x, parts, "int4")
        gate, up = F.linear(q.q8_round(x), dequantize(parts, "gate_up", "int4", torch.float32)).chunk(2, dim=-1)
        want = F.linear(q.q8_round(F.silu(gate) * up), dequantize(parts, "down", "int4", torch.float32))
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    dots = kernels.moe_layer(x, "int4", [parts], [torch.arange(40)], [torch.ones(40)])
    assert (dots - got).norm() / got.norm() < 1e-5
    ids = torch.tensor([[0, 1]] * 40 + [[0, 2]] * 60 + [[2, 3]] * 20)           # rows: 100, 40, 80, 20
    groups = Groups.of(ids, torch.ones(ids.shape))
    assert groups.busy(len(ids), 32) == [True, True, True, False]             # rows: 100, 40, 80, 20
    assert groups.busy(len(ids), 90) == [True, False, False, False]
    assert groups.busy(q.GEMM_TOKENS - 1, 8) == [False] * 4                    # not a prompt chunk


@pytest.mark.parametrize("way", ["dots", "mkl", "onednn"])
def test_a_prompts_product_agrees_whichever_way_runs_it(way, monkeypatch):
    """GEMM_TOKENS or more tokens: the integer dots, or x rounded as the dots round it (int8 codes
    per block of 32, q8_round) times the dequantised matrix in fp32 (MKL, oneDNN); they agree to
    fp32 rounding, and the dots give each token what it gets alone, bit for bit. Fewer tokens: the
    dots, whatever was measured."""
    from moefit import kernels
    from moefit.kernels import gemm
    from moefit.pack import quant as q
    if kernels.library() is None:
        pytest.skip("the native kernel is not built")
    monkeypatch.setattr(gemm, "FORCED", way)
    g = torch.Generator().manual_seed(2)
    parts = dict(zip(["w", "w.scale"], quantize(torch.randn(200, 512, generator=g), "int4", 32)))
    x = torch.randn(q.GEMM_TOKENS, 512, generator=g)
    w = dequantize(parts, "w", "int4", torch.float32)
    exact = q.q8_round(x) @ w.T
    prompt = q.qlinear(x, parts, "w", "int4")
    assert torch.allclose(prompt, exact, rtol=1e-5, atol=1e-4)
    alone = torch.cat([q.qlinear(x[i:i + 1], parts, "w", "int4") for i in range(len(x))])
    assert torch.allclose(alone, prompt, rtol=1e-5, atol=1e-4)
    assert torch.equal(alone, prompt) or way != "dots"
    assert not torch.allclose(x @ w.T, prompt, rtol=1e-5, atol=1e-4)         # fp32 activations: ~1e-2 away
    monkeypatch.setattr(q, "GEMM_MAX_BYTES", 200 * 512 * 4 - 1)       # a matrix above the bound: the dots
    assert torch.equal(q.qlinear(x, parts, "w", "int4"), alone)


def test_a_prompts_product_takes_the_way_measured_fastest_for_its_shape(monkeypatch):
    """kernels/gemm.py: every way timed on the product itself the first time its shape class (rows
    to the next power of two, the matrix) is met, best of REPEATS, interleaved, then the chosen one
    run for the result; later only the chosen one runs. The first way stays unless another is
    MARGIN faster; a way that returns None or raises is out; none left: None."""
    from moefit.kernels import gemm
    monkeypatch.setattr(gemm, "_way_for", {})
    now, ran = [0.0], []

    def way(name, cost, result=1):
        def run():
            ran.append(name)
            now[0] += cost
            return None if result is None else torch.tensor(float(result))
        return run
    clock = lambda: now[0]  # noqa: E731
    ways = {"dots": way("dots", 10.0), "mkl": way("mkl", 5.0, 2), "onednn": way("onednn", 9.5)}
    assert gemm.fastest(("k", 1), ways, clock) == 2 and ran == ["dots", "mkl", "onednn"] * gemm.REPEATS + ["mkl"]
    ran.clear()
    assert gemm.fastest(("k", 1), ways, clock) == 2 and ran == ["mkl"]          # kept: not timed again
    ways["mkl"] = way("mkl", 9.5)                                               # within the margin: the first
    assert gemm.fastest(("k", 2), ways, clock) == 1 and gemm._way_for[("k", 2)] == "dots"
    refuse = lambda: (_ for _ in ()).throw(RuntimeError("refused"))  # noqa: E731
    ways = {"dots": way("dots", 1.0, None), "mkl": way("mkl", 5.0, 3), "onednn": refuse}
    assert gemm.fastest(("k", 3), ways, clock) == 3 and gemm._way_for[("k", 3)] == "mkl"
    assert gemm.fastest(("k", 4), {"dots": way("dots", 1.0, None)}, clock) is None and ("k", 4) not in gemm._way_for
    assert gemm.chosen() == {"mkl": 2, "dots": 1}
    assert gemm.shape_class(65, "int4", 512, 200) == gemm.shape_class(128, "int4", 512, 200) == (128, "int4", 512, 200)
    monkeypatch.setattr(gemm, "FORCED", "onednn")
    assert gemm.fastest(("k", 1), {"dots": way("dots", 1.0), "onednn": way("onednn", 1.0, 4)}, clock) == 4


def test_a_long_prompt_takes_the_gemm_and_decode_steps_the_dots(tmp_path, monkeypatch):
    """With --dense-quant a prompt of GEMM_TOKENS or more may multiply its dense matrices as fp32
    GEMMs (where they are measured fastest: forced here), its logits close to the integer dots'
    (each product agrees to fp32 rounding, tested above; the tiny random model amplifies that:
    1e-7 noise on its GEMMs moves its logits by 4e-3); decode steps never do."""
    import tiny
    from moefit import kernels
    from moefit.config import ServeConfig
    from moefit.kernels import gemm
    from moefit.pack import quant as q
    from moefit.pack.convert import convert
    from moefit.runtime.engine import Engine
    if kernels.library() is None:
        pytest.skip("the native kernel is not built")
    convert(tiny.build_checkpoint("qwen3_moe", tmp_path / "hf"), tmp_path / "pack", "int8", progress=False)
    engine = Engine.open(tmp_path / "pack", ServeConfig(ctx=256, dense_quant="int8"))
    monkeypatch.setattr(gemm, "FORCED", "mkl")
    calls, gap = spied_prefills(engine, monkeypatch, (kernels, "dequantize", lambda *a: a[1]),
                                lambda: monkeypatch.setattr(q, "GEMM_TOKENS", 10 ** 9))
    assert calls and gap < 5e-2


def spied_prefills(engine, monkeypatch, spy, switch_off) -> tuple[list, float]:
    """A prompt of GEMM_TOKENS + 4 prefilled with calls to spy = (module, name, what to record of
    a call's arguments) recorded, a decode step (none), the same prompt after switch_off() (none):
    (the first prefill's records, the two prefills' logits' relative gap)."""
    from moefit.pack import quant as q
    module, name, record = spy
    prompt = [(7 * i) % 300 + 3 for i in range(q.GEMM_TOKENS + 4)]
    calls = []
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(record(*a)) or real(*a, **k))
    first, _ = engine.prefill(prompt)
    recorded = list(calls)
    calls.clear()
    engine.decode_step(5, len(prompt))
    assert not calls
    switch_off()
    engine.kv_tokens = []
    again, _ = engine.prefill(prompt)
    assert not calls
    return recorded, ((first - again).norm() / again.norm()).item()


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])            # gpt-oss: its own expert function
def test_a_prompts_busy_experts_run_as_gemms_and_decode_steps_keep_the_dots(family, tmp_path, monkeypatch):
    """A prompt chunk's experts with --expert-gemm-rows rows or more go through fp32 GEMMs (gemm_first),
    its logits close to the all-dots prefill's (see above); a decode step never does, nor any with off."""
    import tiny
    from moefit import kernels
    from moefit.experts import host_side
    from moefit.config import ServeConfig
    from moefit.pack.convert import convert
    from moefit.runtime.engine import Engine
    if kernels.library() is None:
        pytest.skip("the native kernel is not built")
    convert(tiny.build_checkpoint(family, tmp_path / "hf"), tmp_path / "pack", "int4", progress=False)
    engine = Engine.open(tmp_path / "pack", ServeConfig(ctx=256, expert_gemm_rows="8"))
    rows, gap = spied_prefills(engine, monkeypatch, (host_side, "gemm_first", lambda x, *a: x.shape[0]),
                               lambda: setattr(engine.runner.rates, "setting", "off"))
    assert rows and min(rows) >= 8 and gap < 5e-2


def test_a_long_prompt_chunk_runs_with_the_pools_threads_in_torch(tmp_path, monkeypatch):
    """With --dense-quant torch keeps one thread (decode's small ops); a prompt chunk of GEMM_TOKENS
    or more runs its whole forward (DeltaNet's chunked form, attention, norms) with the pool's."""
    import tiny
    from moefit import kernels
    from moefit.config import ServeConfig
    from moefit.pack import quant as q
    from moefit.pack.convert import convert
    from moefit.runtime.engine import Engine
    if kernels.library() is None:
        pytest.skip("the native kernel is not built")
    convert(tiny.build_checkpoint("qwen3_moe", tmp_path / "hf"), tmp_path / "pack", "int8", progress=False)
    engine = Engine.open(tmp_path / "pack", ServeConfig(ctx=256, dense_quant="int8", threads=2))
    assert torch.get_num_threads() == 1
    seen = []
    real = engine.forward
    monkeypatch.setattr(engine, "forward", lambda *a, **k: seen.append(torch.get_num_threads()) or real(*a, **k))
    engine.prefill([(7 * i) % 300 + 3 for i in range(q.GEMM_TOKENS + 4)])
    engine.kv_tokens = []
    engine.prefill([5, 6, 7])
    assert seen == [2, 1] and torch.get_num_threads() == 1


def test_where_the_expert_gemm_pays_is_measured_on_this_machine(packs):
    """crossover: each path a line through two timed row counts, the rows where they cross (never
    where the GEMMs do not catch up); auto measures it once per quant at the first prompt chunk,
    on the layer's own experts; a number or off is taken as given; anything else is refused."""
    from moefit import kernels
    from moefit.config import ServeConfig
    from moefit.errors import UsageError
    from moefit.experts.costs import NEVER, crossover
    from moefit.pack import quant as q
    from moefit.runtime.engine import Engine
    lines = {False: (1.0, 0.1), True: (3.0, 0.02)}                           # dots, GEMMs: fixed + per row
    assert crossover(lambda n, gemm: lines[gemm][0] + lines[gemm][1] * n, margin=0) == 25
    assert crossover(lambda n, gemm: lines[gemm][0] + lines[gemm][1] * n) == 30          # 10 % below the dots
    lines[True] = (3.0, 0.1)
    assert crossover(lambda n, gemm: lines[gemm][0] + lines[gemm][1] * n) == NEVER
    lines[True] = (0.5, 0.02)                                                  # GEMMs faster everywhere
    assert crossover(lambda n, gemm: lines[gemm][0] + lines[gemm][1] * n) == 16
    if kernels.library() is None:
        pytest.skip("the native kernel is not built")
    engine = Engine.open(packs("qwen3_moe", "int4"), ServeConfig(ctx=256))
    timed = []
    real = engine.runner.rates.time_experts
    engine.runner.rates.time_experts = lambda *a: timed.append(a) or real(*a)
    engine.prefill([(7 * i) % 300 + 3 for i in range(q.GEMM_TOKENS + 4)])
    assert set(engine.runner.rates.crossovers) == {"int4"} and len(timed) == 20      # 2 counts x 2 paths x best of 5
    engine.forget_prefix()
    engine.prefill([(5 * i) % 300 + 3 for i in range(q.GEMM_TOKENS + 4)])
    assert len(timed) == 20                                                     # measured once
    assert Engine.open(packs("qwen3_moe", "int4"), ServeConfig(ctx=256, expert_gemm_rows="off")).runner.rates.gemm_rows(
        0, "int4") == NEVER
    with pytest.raises(UsageError, match="--expert-gemm-rows 0"):
        Engine.open(packs("qwen3_moe", "int4"), ServeConfig(ctx=256, expert_gemm_rows="0"))


def test_a_prompt_gemm_takes_the_faster_of_mkl_and_onednn_per_shape(monkeypatch):
    """gemm.linear (a busy expert's GEMM): either backend is an fp32 GEMM, equal to F.linear to
    fp32 rounding; oneDNN refusing or missing leaves MKL."""
    import torch.nn.functional as F
    from moefit.kernels import gemm
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(100, 256, generator=g), torch.randn(96, 256, generator=g)
    want = F.linear(x, w)
    for way in ("mkl", "onednn"):
        monkeypatch.setattr(gemm, "FORCED", way)
        assert torch.allclose(gemm.linear(x, w), want, rtol=1e-5, atol=1e-4)
    monkeypatch.setattr(gemm, "FORCED", None)
    monkeypatch.setattr(gemm, "_way_for", {})
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert torch.allclose(gemm.linear(x, w), want, rtol=1e-5, atol=1e-4) and gemm.chosen() == {"mkl": 1}

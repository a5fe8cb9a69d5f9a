"""The native host kernel against a torch reference that quantises activations the same
way (q8 per block of 32): every quant type, T in {1, 3, 8, 64}, odd shapes, 1 and 2 threads."""

import pytest
import torch

from moefit import kernels
from moefit.pack.layout import GGUF_BLOCKS, matrix_quants
from moefit.pack.quant import dequantize, quantize
from narrow_isa import NARROWER, check_under, computed_under

pytestmark = pytest.mark.skipif(kernels.library() is None, reason="the native kernel is not built")


def q8(x: torch.Tensor) -> torch.Tensor:
    """x with each block of 32 rounded to int8 codes times its absmax / 127 (llama.cpp's q8_0)."""
    b = x.reshape(*x.shape[:-1], -1, 32)
    d = b.abs().amax(-1, keepdim=True) / 127
    return (torch.round(b / torch.where(d == 0, 1, d)) * d).reshape(x.shape)


def reference(x, quant, experts, rows, weights):
    out = torch.zeros_like(x, dtype=torch.float64)
    for p, r, w in zip(experts, rows, weights):
        gu = dequantize(p, "gate_up", quant, torch.float64)
        dn = dequantize(p, "down", quant, torch.float64)
        gate, up = (q8(x[r]).double() @ gu.T).chunk(2, -1)
        h = q8((torch.nn.functional.silu(gate) * up).float()).double()
        out.index_add_(0, r, (h @ dn.T) * w[:, None].double())
    return out.float()


SUPER = ("q4_k", "q5_k", "q6_k", "iq4_xs", "mxfp4", "q4_k/q6_k", "iq4_xs/q5_k")


def gguf_blocks(quant: str, rows: int, cols: int, g) -> list[torch.Tensor]:
    """Random GGUF blocks (moefit never makes them: they come from files), tests/gguf_writer.py's."""
    import gguf
    from gguf_writer import super_blocks
    qtype = getattr(gguf.GGMLQuantizationType, quant.upper())
    return [torch.from_numpy(super_blocks((rows, cols), qtype, int(torch.randint(1 << 30, (1,), generator=g))))]


def matrix(quant: str, rows: int, cols: int, g) -> list[torch.Tensor]:
    if quant in GGUF_BLOCKS:
        return gguf_blocks(quant, rows, cols, g)
    return quantize(torch.randn(rows, cols, generator=g), quant, 32)


def make(quant, hidden, inter, n_experts, tokens, seed):
    g = torch.Generator().manual_seed(seed)
    gate_up, down = matrix_quants(quant)
    experts = []
    for _ in range(n_experts):
        p = dict(zip(["gate_up", "gate_up.scale"], matrix(gate_up, 2 * inter, hidden, g)))
        p.update(zip(["down", "down.scale"], matrix(down, hidden, inter, g)))
        experts.append(p)
    x = torch.randn(tokens, hidden, generator=g)
    rows = [torch.nonzero(torch.rand(tokens, generator=g) < 0.6)[:, 0] for _ in experts]
    rows = [r if len(r) else torch.tensor([tokens - 1]) for r in rows]
    return x, experts, rows, [torch.rand(len(r), generator=g) for r in rows]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("tokens", [1, 3, 8, 64])
@pytest.mark.parametrize("quant", ["int8", "int4", "q8_0"])
def test_one_call_per_layer_matches_the_reference(quant, tokens, threads):
    kernels.set_threads(threads)
    try:
        for hidden, inter, n in ((96, 64, 3), (160, 224, 5), (544, 768, 2)):   # 3, 5, 17 and 24 blocks a row
            x, experts, rows, weights = make(quant, hidden, inter, n, tokens, seed=tokens + hidden)
            got = kernels.moe_layer(x, quant, experts, rows, weights)
            want = reference(x, quant, experts, rows, weights)
            # 1e-3: now and then an intermediate activation rounds to the neighbouring int8 code
            # (float32 in the kernel, float64 here); q8 itself costs ~1e-2, a layout bug ~1.
            assert (got - want).norm() / want.norm() < 1e-3
    finally:
        kernels.set_threads(kernels.default_threads())


@pytest.mark.parametrize("tokens", [1, 5, 64])
@pytest.mark.parametrize("quant", SUPER)
def test_gguf_blocks_are_multiplied_as_the_file_stores_them(quant, tokens):
    """Q4_K, Q5_K, Q6_K, IQ4_XS and MXFP4 (and a layer mixing two, as Q4_K_M files do) straight from
    their blocks, against the reference on the same blocks dequantised (pack/kblocks.py, itself checked
    against gguf.quants in test_gguf.py). MXFP4 also at widths of 10 and 9 blocks: a group of eight
    blocks, then blocks one at a time (ktiles.h)."""
    for hidden, inter, n in ((256, 256, 3), (512, 768, 2)) + (((320, 288, 2),) if quant == "mxfp4" else ()):
        x, experts, rows, weights = make(quant, hidden, inter, n, tokens, seed=tokens + hidden)
        got = kernels.moe_layer(x, quant, experts, rows, weights)
        want = reference(x, quant, experts, rows, weights)
        assert (got - want).norm() / want.norm() < 1e-3


@pytest.mark.parametrize("group", [64, 128])
@pytest.mark.parametrize("tokens", [1, 3])
def test_int4_groups_wider_than_a_block(group, tokens):
    """int4 scales per 64 or 128 columns (the AVX512 body's pair-at-a-time path, not its 16-block one)."""
    g = torch.Generator().manual_seed(group + tokens)
    hidden, inter = 3 * group, 2 * group
    experts = []
    for _ in range(3):
        p = dict(zip(["gate_up", "gate_up.scale"], quantize(torch.randn(2 * inter, hidden, generator=g), "int4", group)))
        p.update(zip(["down", "down.scale"], quantize(torch.randn(hidden, inter, generator=g), "int4", group)))
        experts.append(p)
    x = torch.randn(tokens, hidden, generator=g)
    rows = [torch.arange(tokens)] * 3
    weights = [torch.rand(tokens, generator=g) for _ in range(3)]
    got = kernels.moe_layer(x, "int4", experts, rows, weights)
    want = reference(x, "int4", experts, rows, weights)
    assert (got - want).norm() / want.norm() < 1e-3


def test_the_thread_count_does_not_change_a_bit():
    x, experts, rows, weights = make("int4", 128, 96, 6, 8, seed=5)
    outs = []
    for threads in (1, 2):
        kernels.set_threads(threads)
        outs.append(kernels.moe_layer(x, "int4", experts, rows, weights))
    kernels.set_threads(kernels.default_threads())
    assert torch.equal(outs[0], outs[1])


def test_shapes_the_kernel_does_not_take_return_none():
    x, experts, rows, weights = make("int8", 40, 32, 2, 2, seed=1)       # hidden 40: not a multiple of 32
    assert kernels.moe_layer(x, "int8", experts, rows, weights) is None


@pytest.mark.parametrize("quant", ["int8", "int4", "q8_0"])
@pytest.mark.parametrize("tokens", [1, 5])
def test_a_single_matrix_matches_the_reference(quant, tokens):
    g = torch.Generator().manual_seed(tokens)
    parts = dict(zip(["w", "w.scale"], quantize(torch.randn(70, 64, generator=g), quant, 32)))
    x = torch.randn(tokens, 64, generator=g)
    want = q8(x).double() @ dequantize(parts, "w", quant, torch.float64).T
    got = kernels.qlinear(x, parts, "w", quant)
    assert (got - want).norm() / want.norm() < 1e-5


@pytest.mark.parametrize("quant", ["int8", "int4", "q8_0"])
def test_gpt_oss_experts_run_in_the_native_call_as_in_torch(quant, packs):
    """gpt-oss's experts (biases, clamped and alpha-scaled gate) in the one native call per layer
    equal the family's torch expert on the same blobs (the native call rounds activations to 8 bits)."""
    from moefit.config import ServeConfig
    from moefit.experts.runner import Groups
    from moefit.runtime.engine import Engine
    engine = Engine.open(packs("gpt_oss", quant), ServeConfig(ctx=64))
    runner, m = engine.runner, engine.pack.model
    gen = torch.Generator().manual_seed(3)
    x = 3 * torch.randn(6, m.hidden_size, generator=gen)                 # large enough to reach the clamps
    ids = torch.stack([torch.randperm(m.num_experts, generator=gen)[: m.top_k] for _ in range(6)])
    groups = Groups.of(ids, torch.rand(6, m.top_k, generator=gen))
    native = runner._host_experts(0, x, groups)
    act, runner.native_act = runner.native_act, None                     # the torch path
    try:
        torch_path = runner._host_experts(0, x, groups)
    finally:
        runner.native_act = act
    assert act is not None and not torch.equal(native, torch_path)      # two different computations ...
    torch.testing.assert_close(native, torch_path, rtol=3e-2, atol=3e-2)  # ... that agree


def check_every_quant() -> str:
    """The layer call against the reference for every quant; the instruction set it ran on."""
    for quant in ("int8", "int4", "q8_0") + SUPER:
        for tokens in (1, 5):
            shape = (512, 256) if quant in SUPER else (160, 224)
            x, experts, rows, weights = make(quant, *shape, 5, tokens, seed=tokens)
            got = kernels.moe_layer(x, quant, experts, rows, weights)
            want = reference(x, quant, experts, rows, weights)
            assert (got - want).norm() / want.norm() < 1e-3, (quant, tokens)
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(1)) * torch.linspace(0, 3, 40)[:, None]
    assert torch.equal(kernels.q8_round(x), q8_round_reference(x))          # row 0: all zeros
    return kernels.isa()


def q8_round_reference(x: torch.Tensor) -> torch.Tensor:
    """Each block of 32: round-half-even(x / d) * d, d = amax / 127 (quantize_row's codes and scale)."""
    blocks = x.view(x.shape[0], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    return (torch.round(blocks * torch.where(d > 0, 1 / d, torch.zeros_like(d))) * d).view(x.shape)


def test_a_prompts_activations_are_rounded_as_the_dots_round_them():
    """kernels.q8_round (what a prompt's GEMMs multiply, pack/quant.py) equals the codes times the
    scale quantize_row makes, bit for bit; a row that is not whole blocks is refused."""
    if kernels.library() is None:
        pytest.skip("the native kernel is not built")
    check_every_quant()
    assert kernels.q8_round(torch.randn(3, 48)) is None


@pytest.mark.parametrize("isa", NARROWER)
def test_the_narrower_instruction_sets_match_the_reference_too(isa):
    """Users' CPUs: AVX2 everywhere, AVX-VNNI or AVX512 on some; MOEFIT_ISA caps what the kernel
    picks, so every path runs on this machine."""
    check_under(isa, "test_kernels", "check_every_quant")


def check_int4_panels() -> str:
    """int4 in panels of eight rows (panels.h, every SIMD body's): 43 rows (five panels and three rows
    a row at a time), 9 blocks of columns (8 groups of scales packed at once, then one), groups of
    32 and 96; 1 to 9 tokens (tiles of 4, 4 and 1): each token's outputs are those it gets alone,
    bit for bit, and equal the reference (to 1e-5; every body lands near 1e-7)."""
    g = torch.Generator().manual_seed(7)
    for group in (32, 96):
        parts = dict(zip(["w", "w.scale"], quantize(torch.randn(43, 288, generator=g), "int4", group)))
        x = torch.randn(9, 288, generator=g)
        alone = torch.cat([kernels.qlinear(x[t:t + 1], parts, "w", "int4") for t in range(9)])
        want = q8(x).double() @ dequantize(parts, "w", "int4", torch.float64).T
        for tokens in range(1, 10):
            assert torch.equal(kernels.qlinear(x[:tokens], parts, "w", "int4"), alone[:tokens]), (group, tokens)
        assert (alone - want).norm() / want.norm() < 1e-5, group            # ~1e-7 here; a fault ~1e-3
        stored = dict(zip(["w", "w.scale"], kernels.rows_to_panels(parts["w"], parts["w.scale"])))
        in_torch = kernels._reorder(parts["w"], parts["w.scale"], to_panels=True)     # natively made: the same bytes
        assert torch.equal(stored["w"], in_torch[0]) and torch.equal(stored["w.scale"], in_torch[1])
        if kernels.int4_panels():                  # stored in panels: the same tiles, the same bits
            assert torch.equal(kernels.qlinear(x, stored, "w", "int4p"), alone), group
            assert torch.equal(kernels.qlinear(x[:1], stored, "w", "int4p"), alone[:1]), group
        else:                                      # refused where the kernel has no panels
            assert kernels.qlinear(x, stored, "w", "int4p") is None
    return kernels.isa()


def check_kquant_tiles() -> str:
    """Every GGUF block type and a Q4_K_M-style mix through ktiles.h's tiles of up to four tokens: 1
    to 9 tokens (tiles of 4, 4 and 1), each expert taking every token: each token's output is the
    one it gets alone, bit for bit. MXFP4 at 320 columns: a group of eight blocks and two alone."""
    for seed, quant in enumerate(("q4_k", "q5_k", "q6_k", "iq4_xs", "mxfp4", "q4_k/q6_k"), start=21):
        x, experts, _, _ = make(quant, 320 if quant == "mxfp4" else 512, 256, 3, 9, seed=seed)
        w = torch.rand(9, 3, generator=torch.Generator().manual_seed(seed))
        def layer(t0, t1):
            rows = [torch.arange(t1 - t0)] * 3
            return kernels.moe_layer(x[t0:t1], quant, experts, rows, [w[t0:t1, e] for e in range(3)])
        alone = torch.cat([layer(t, t + 1) for t in range(9)])
        for tokens in range(1, 10):
            assert torch.equal(layer(0, tokens), alone[:tokens]), (quant, tokens)
    return kernels.isa()


def check_k_quant_extremes() -> str:
    """Q4_K and Q5_K experts whose codes are all at their largest (15, 31) against activations at
    +-127 in every block: each sub-block's 32 products are the most its integer sums ever hold (a
    Q4_K sub-block in one int16 chain on AVX2, 16 x 15 x 127 = 30480; Q5_K's halves apart, kpanels.h).
    A wrapped sum is off by 65536 x a scale; here 1, 4 and 9 tokens (a tile, a panel, decoded
    panels) meet the reference."""
    for seed, quant in enumerate(("q4_k", "q5_k"), start=31):
        x, experts, _, _ = make(quant, 512, 256, 2, 9, seed=seed)
        size, codes = (144, slice(16, 144)) if quant == "q4_k" else (176, slice(16, 176))  # Q5_K: fifth bits, nibbles
        for p in experts:
            blocks = p["gate_up"].view(p["gate_up"].shape[0], -1, size)     # [rows, super-blocks, bytes]
            blocks[:, :, codes] = 0xFF                                      # every super-block of every row
        sign = torch.where(torch.arange(9)[:, None] % 2 == 0, 1.0, -1.0)
        x = sign * torch.full((9, 512), 3.0)                                 # every block's q8 codes +-127
        for tokens in (1, 4, 9):
            rows = [torch.arange(tokens)] * 2
            weights = [torch.full((tokens,), 0.5)] * 2
            got = kernels.moe_layer(x[:tokens], quant, experts, rows, weights)
            want = reference(x[:tokens], quant, experts, rows, weights)
            assert (got - want).norm() / want.norm() < 1e-3, (quant, tokens)
    return kernels.isa()


@pytest.mark.parametrize("isa", [None, "avx2", "avx-vnni"])
def test_k_quant_sums_hold_their_largest_values(isa):
    check_k_quant_extremes() if isa is None else check_under(isa, "test_kernels", "check_k_quant_extremes")


@pytest.mark.parametrize("isa", [None, "avx2", "avx-vnni"])
def test_k_quant_rows_give_each_token_what_it_gets_alone(isa):
    """This CPU's own tiles in-process (None), the narrower ones in a subprocess."""
    check_kquant_tiles() if isa is None else check_under(isa, "test_kernels", "check_kquant_tiles")


def test_int4_panel_order_is_a_reordering_of_the_rows_bytes():
    """kernels.rows_to_panels / panels_to_rows (a dense int4 matrix kept as the SIMD kernels read
    it, "int4p"): a round trip gives the bytes back; the first rows - rows % 8 rows are reordered,
    the rest kept; dequantising either way gives the same weights."""
    g = torch.Generator().manual_seed(3)
    for rows in (43, 64, 5):
        codes, scale = quantize(torch.randn(rows, 288, generator=g), "int4", 32)
        stored = dict(zip(["w", "w.scale"], kernels.rows_to_panels(codes, scale)))
        back = kernels.panels_to_rows(stored, "w")
        assert torch.equal(back["w"], codes) and torch.equal(back["w.scale"], scale)
        head = rows - rows % 8
        assert torch.equal(stored["w"][head:], codes[head:]) and (head == 0 or not torch.equal(stored["w"], codes))
        # panel 0, block 0, quad 1 holds each of rows 0-7's bytes 4-7 of block 0
        assert torch.equal(stored["w"].flatten()[32:64].view(8, 4), codes[:8, 4:8]) or head == 0
        plain = dequantize({"w": codes, "w.scale": scale}, "w", "int4", torch.float32)
        assert torch.equal(dequantize(stored, "w", "int4p", torch.float32), plain)
        if kernels.library() is not None:
            assert torch.equal(kernels.dequantize(stored, "w", "int4p"), plain)


@pytest.mark.parametrize("isa", [None, "avx2", "avx-vnni"])
def test_int4_rows_in_panels_give_each_token_what_it_gets_alone(isa):
    check_int4_panels() if isa is None else check_under(isa, "test_kernels", "check_int4_panels")


def test_torchs_openmp_workers_sleep_unless_the_user_says_otherwise():
    """moefit/__init__.py: OMP_WAIT_POLICY passive before torch loads (its spinning workers took
    the native pool's cores), a policy the user set kept."""
    import os
    import subprocess
    import sys
    show = "import moefit, os, torch; print(os.environ['OMP_WAIT_POLICY'])"
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    assert subprocess.run([sys.executable, "-c", show], env=env, capture_output=True, text=True,
                          check=True).stdout.strip() == "PASSIVE"
    assert subprocess.run([sys.executable, "-c", show], env={**env, "OMP_WAIT_POLICY": "active"},
                          capture_output=True, text=True, check=True).stdout.strip() == "active"


def kquant_layers() -> torch.Tensor:
    """Q4_K, Q5_K, Q6_K, IQ4_XS and MXFP4 layers (ktiles.h) over 5 tokens, side by side."""
    outs = []
    for seed, quant in enumerate(("q4_k", "q5_k", "q6_k", "iq4_xs", "mxfp4"), start=11):
        x, experts, rows, weights = make(quant, 512, 256, 3, 5, seed=seed)
        outs.append(kernels.moe_layer(x, quant, experts, rows, weights).flatten())
    return torch.cat(outs)


def int4_panel_outputs() -> torch.Tensor:
    """int4 through the panel tiles: a layer of three experts (rearranged per call) over 5 tokens,
    and a 43-row matrix stored in panels over 1 and 6 tokens, side by side."""
    x, experts, rows, weights = make("int4", 512, 256, 3, 5, seed=12)
    layer = kernels.moe_layer(x, "int4", experts, rows, weights)
    g = torch.Generator().manual_seed(13)
    stored = dict(zip(["w", "w.scale"], kernels.rows_to_panels(*quantize(torch.randn(43, 512, generator=g), "int4", 32))))
    y = torch.randn(6, 512, generator=g)
    one, six = kernels.qlinear(y[:1], stored, "w", "int4p"), kernels.qlinear(y, stored, "w", "int4p")
    return torch.cat([layer.flatten(), one.flatten(), six.flatten()])


def beside_avx2(tmp_path, make_outputs: str, isa: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """test_kernels.make_outputs() under isa's bodies (None: this CPU's own, in-process) and under
    AVX2's; skipped where the two would be the same code (this CPU's bodies are AVX2's or portable)."""
    if isa is None and kernels.isa() in ("avx2", "portable"):
        pytest.skip(f"this CPU's bodies are {kernels.isa()}'s: nothing to compare with AVX2's")
    if isa == kernels.isa():
        pytest.skip(f"this CPU's own bodies are {isa}'s: compared in-process")
    mine = globals()[make_outputs]() if isa is None else computed_under(isa, "test_kernels", make_outputs, tmp_path)
    return mine, computed_under("avx2", "test_kernels", make_outputs, tmp_path)


@pytest.mark.parametrize("isa", [None, "avx-vnni"])
def test_k_quants_give_the_same_bits_on_every_instruction_set(tmp_path, isa):
    """The K-quant tiles add the same integers with maddubs or dpbusd and scale them in the same
    order: every GGUF block type's layer equals, bit for bit, what AVX2's tiles give (in a
    subprocess capped with MOEFIT_ISA), with this CPU's own tiles and with AVX-VNNI's."""
    assert torch.equal(*beside_avx2(tmp_path, "kquant_layers", isa))


@pytest.mark.parametrize("isa", [None, "avx-vnni"])
def test_int4_panels_give_the_same_bits_on_every_instruction_set(tmp_path, isa):
    """The VNNI panel tiles (dpbusd into int32) add the same integers AVX2's do (maddubs into
    int16, then widened) and scale them in the same order: int4 rearranged per call and stored in
    panels equal, bit for bit, what the AVX2 body gives."""
    assert torch.equal(*beside_avx2(tmp_path, "int4_panel_outputs", isa))

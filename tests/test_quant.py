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


def test_mixed_recipe_keeps_edge_layers_at_int8():
    assert layer_quants("mixed", [0, 2, 3, 5]) == {0: "int8", 2: "int4", 3: "int4", 5: "int8"}
    int8 = blob_nbytes(expert_layout(2048, 768, "int8", 32))
    int4 = blob_nbytes(expert_layout(2048, 768, "int4", 32))
    assert int4 < int8 < 2 * int4 + 4096

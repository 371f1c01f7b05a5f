"""KVarN's packed tile (kvarn/layout.py): sections that tile the bytes without overlap, a page
that vLLM 0.26's own TQFullAttentionSpec budgets exactly, packing that round-trips, and the
bytes per token against bf16 and fp8."""

from __future__ import annotations

import itertools

import pytest
import torch

from hyperqwen.kvarn import layout as kvarn_layout
from hyperqwen.kvarn.layout import TileLayout, bytes_per_token, pack_tile, unpack_tile
from hyperqwen.kvarn.quantize import QuantizedTile


@pytest.mark.parametrize("head_dim", [64, 128, 256, 512])
def test_sections_are_aligned_disjoint_and_inside_the_tile(head_dim):
    layout = TileLayout(head_dim=head_dim)
    spans = sorted(layout.sections.values())
    assert all(offset % kvarn_layout.SECTION_ALIGN == 0 for offset, _ in spans)
    assert all(a + size <= b for (a, size), (b, _) in itertools.pairwise(spans))
    assert spans[-1][0] + spans[-1][1] <= layout.tile_bytes
    assert layout.tile_bytes == layout.slot_bytes * layout.tokens
    t, d = layout.tokens, head_dim
    payload = t * d // 2 + t * d // 4 + 2 * (2 * d + t) + 2 * (2 * t)  # codes + fp16 numbers
    assert payload <= layout.tile_bytes < payload + kvarn_layout.SECTION_ALIGN * 7 + layout.tokens


def test_the_27b_page_is_what_vllms_tq_spec_budgets():
    from vllm.v1.kv_cache_interface import TQFullAttentionSpec

    layout = TileLayout()
    spec = TQFullAttentionSpec(block_size=128, num_kv_heads=4, head_size=256, dtype=torch.uint8,
                               tq_slot_size=layout.slot_bytes)  # fmt: skip
    assert spec.page_size_bytes == 4 * layout.tile_bytes
    assert torch.Size(layout.pool_shape(7, 4)).numel() == 7 * spec.page_size_bytes


def test_packing_round_trips_every_field():
    layout = TileLayout(head_dim=256)
    g = torch.Generator().manual_seed(3)
    fp16 = lambda *shape: torch.randn(*shape, generator=g).to(torch.float16).double()  # noqa: E731
    tile = QuantizedTile(
        k_codes=torch.randint(0, 16, (128, 256), generator=g),
        k_scale=fp16(256), k_zero=fp16(256), k_token_scale=fp16(128),
        v_codes=torch.randint(0, 4, (128, 256), generator=g),
        v_scale=fp16(128), v_zero=fp16(128),
    )  # fmt: skip
    raw = pack_tile(tile, layout)
    assert raw.dtype == torch.uint8 and raw.shape == (layout.tile_bytes,)
    back = unpack_tile(raw, layout)
    for name in tile.__dataclass_fields__:
        assert torch.equal(getattr(back, name), getattr(tile, name)), name
    first_k_byte = layout.sections["k_codes"][0]
    assert raw[first_k_byte] == tile.k_codes[0, 0] | tile.k_codes[0, 1] << 4  # little end first


def test_kvarn_takes_under_half_of_fp8_and_the_16_bit_tiles_fade_with_context():
    layout = TileLayout()
    assert bytes_per_token(layout) < 0.45 * kvarn_layout.fp8_bytes_per_token(256)
    at_112k = bytes_per_token(layout, 114688)
    assert bytes_per_token(layout) < at_112k < 1.02 * bytes_per_token(layout)
    assert bytes_per_token(layout, 4096) > bytes_per_token(layout, 32768) > at_112k


def test_a_pool_of_another_shape_is_refused_with_what_it_must_be():
    with pytest.raises(ValueError, match=r"uint8 \[num_blocks, num_kv_heads, 26368\]"):
        TileLayout().check_pool(torch.zeros(2, 4, 1024, dtype=torch.uint8))

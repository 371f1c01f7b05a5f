"""KVarN's packed tile (kvarn/layout.py): sections that tile the bytes without overlap, a page
that vLLM 0.26's own TQFullAttentionSpec budgets exactly, packing that round-trips, and the
bytes per token against bf16 and fp8; for tiles of 2-bit values and of 3-bit ones (the 2-bit
tile with the v_high plane appended)."""

from __future__ import annotations

import itertools

import pytest
import torch

from hyperqwen.kvarn import layout as kvarn_layout
from hyperqwen.kvarn.layout import TileLayout, bytes_per_token
from hyperqwen.kvarn.packing import pack_tile, unpack_tile
from hyperqwen.kvarn.quantize import QuantizedTile


@pytest.mark.parametrize("v_bits", [2, 3])
@pytest.mark.parametrize("head_dim", [64, 128, 256, 512])
def test_sections_are_aligned_disjoint_and_inside_the_tile(head_dim, v_bits):
    layout = TileLayout(head_dim=head_dim, v_bits=v_bits)
    spans = sorted(layout.sections.values())
    assert all(offset % kvarn_layout.SECTION_ALIGN == 0 for offset, _ in spans)
    assert all(a + size <= b for (a, size), (b, _) in itertools.pairwise(spans))
    assert spans[-1][0] + spans[-1][1] <= layout.tile_bytes
    assert layout.tile_bytes == layout.slot_bytes * layout.tokens
    t, d = layout.tokens, head_dim
    payload = t * d // 2 + t * d * v_bits // 8 + 2 * (2 * d + t) + 2 * (2 * t)  # codes + fp16
    assert payload <= layout.tile_bytes < payload + kvarn_layout.SECTION_ALIGN * 8 + layout.tokens


@pytest.mark.parametrize("head_dim", [64, 256])
def test_a_3_bit_tile_is_the_2_bit_tile_with_the_high_plane_appended(head_dim):
    two, three = TileLayout(head_dim=head_dim), TileLayout(head_dim=head_dim, v_bits=3)
    assert two.sections["v_high"][1] == 0 and three.sections["v_high"][1] == 128 * head_dim // 8
    assert three.offsets._replace(v_high=0) == two.offsets._replace(v_high=0)
    assert three.sections["v_high"][0] >= two.tile_bytes - two.tokens
    assert (two.v_levels, three.v_levels) == (3, 7)
    if head_dim == 256:  # the 27B's: 206 and 238 bytes per token and KV head
        assert (two.tile_bytes, three.tile_bytes) == (26368, 30464)


def test_other_value_bits_are_refused_by_name():
    for v_bits in (1, 4, "3"):
        with pytest.raises(ValueError, match=rf"v_bits={v_bits!r}: a KVarN tile stores values "
                           "in 2 or 3 bits"):  # fmt: skip
            TileLayout(v_bits=v_bits)


def test_the_knob_and_the_bench_offer_the_layouts_value_bits():
    """The bits are spelled three times (the layout, the knob's values, kvarn.bench's choices;
    the knob's module stays torch-free): they must agree."""
    from hyperqwen.engine.features import KVARN_V_BITS
    from hyperqwen.kvarn.bench import build_parser

    offered = tuple(map(str, kvarn_layout.V_BITS_CHOICES))
    assert KVARN_V_BITS.owned_knob.values == offered
    assert KVARN_V_BITS.unset == str(kvarn_layout.V_BITS)
    (v_bits,) = (a for a in build_parser()._actions if a.dest == "v_bits")
    assert tuple(v_bits.choices) == kvarn_layout.V_BITS_CHOICES
    assert v_bits.default == kvarn_layout.V_BITS


@pytest.mark.parametrize("v_bits", [2, 3])
def test_the_27b_page_is_what_vllms_tq_spec_budgets(v_bits):
    from vllm.v1.kv_cache_interface import TQFullAttentionSpec

    layout = TileLayout(v_bits=v_bits)
    spec = TQFullAttentionSpec(block_size=128, num_kv_heads=4, head_size=256, dtype=torch.uint8,
                               tq_slot_size=layout.slot_bytes)  # fmt: skip
    assert spec.page_size_bytes == 4 * layout.tile_bytes
    assert torch.Size(layout.pool_shape(7, 4)).numel() == 7 * spec.page_size_bytes


def random_tile(v_bits: int, seed: int = 3) -> QuantizedTile:
    g = torch.Generator().manual_seed(seed)
    fp16 = lambda *shape: torch.randn(*shape, generator=g).to(torch.float16).double()  # noqa: E731
    return QuantizedTile(
        k_codes=torch.randint(0, 16, (128, 256), generator=g),
        k_scale=fp16(256), k_zero=fp16(256), k_token_scale=fp16(128),
        v_codes=torch.randint(0, 2**v_bits, (128, 256), generator=g),
        v_scale=fp16(128), v_zero=fp16(128),
    )  # fmt: skip


@pytest.mark.parametrize("v_bits", [2, 3])
def test_packing_round_trips_every_field(v_bits):
    layout = TileLayout(head_dim=256, v_bits=v_bits)
    tile = random_tile(v_bits)
    raw = pack_tile(tile, layout)
    assert raw.dtype == torch.uint8 and raw.shape == (layout.tile_bytes,)
    back = unpack_tile(raw, layout)
    for name in tile.__dataclass_fields__:
        assert torch.equal(getattr(back, name), getattr(tile, name)), name
    first_k_byte = layout.sections["k_codes"][0]
    assert raw[first_k_byte] == tile.k_codes[0, 0] | tile.k_codes[0, 1] << 4  # little end first
    v = tile.v_codes[0, :4] & 3
    assert raw[layout.sections["v_codes"][0]] == v[0] | v[1] << 2 | v[2] << 4 | v[3] << 6
    if v_bits == 3:  # bit 2 of channels 0-7 in the first plane byte, channel i at bit i
        high = (tile.v_codes[0, :8] >> 2).tolist()
        assert raw[layout.sections["v_high"][0]] == sum(bit << i for i, bit in enumerate(high))


def test_a_3_bit_code_is_refused_by_a_2_bit_tile():
    tile = random_tile(3)
    with pytest.raises(ValueError, match="value code 7 in a tile of 2-bit values"):
        pack_tile(tile, TileLayout())


def test_kvarn_takes_under_half_of_fp8_and_the_16_bit_tiles_fade_with_context():
    layout = TileLayout()
    assert bytes_per_token(layout) < 0.45 * kvarn_layout.fp8_bytes_per_token(256)
    at_112k = bytes_per_token(layout, 114688)
    assert bytes_per_token(layout) < at_112k < 1.02 * bytes_per_token(layout)
    assert bytes_per_token(layout, 4096) > bytes_per_token(layout, 32768) > at_112k


def test_3_bit_values_cost_a_sixth_more_and_stay_under_half_of_fp8():
    two, three = TileLayout(), TileLayout(v_bits=3)
    assert bytes_per_token(three) == bytes_per_token(two) + 256 / 8
    assert bytes_per_token(three, 114688) < 0.5 * kvarn_layout.fp8_bytes_per_token(256)
    table = kvarn_layout.bytes_table()
    assert "| KVarN, 2-bit V: tiles (pool only) | 206.0 |" in table
    assert "| KVarN, 3-bit V: tiles (pool only) | 238.0 |" in table
    assert "| v_high | 26368 | 4096 |" in kvarn_layout.__doc__


def test_a_pool_of_another_shape_is_refused_with_what_it_must_be():
    with pytest.raises(ValueError, match=r"uint8 \[num_blocks, num_kv_heads, 26368\]"):
        TileLayout().check_pool(torch.zeros(2, 4, 1024, dtype=torch.uint8))
    two_bit_pool = torch.zeros(TileLayout().pool_shape(2, 4), dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"30464\] with contiguous tiles \(3-bit values\)"):
        TileLayout(v_bits=3).check_pool(two_bit_pool)

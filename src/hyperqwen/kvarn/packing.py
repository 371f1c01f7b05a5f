"""KVarN's tile as bytes and back, in torch: the reference the store and dequantize kernels
are tested against (layout.py says where each section lies)."""

from __future__ import annotations

import torch

from hyperqwen.kvarn.layout import FP16_SECTIONS, TileLayout
from hyperqwen.kvarn.quantize import QuantizedTile


def _section(raw: torch.Tensor, layout: TileLayout, name: str) -> torch.Tensor:
    offset, size = layout.sections[name]
    return raw[offset : offset + size]


def pack_tile(tile: QuantizedTile, layout: TileLayout) -> torch.Tensor:
    """The tile's bytes, uint8 [tile_bytes], padding zero (the reference for store.py)."""
    raw = torch.zeros(layout.tile_bytes, dtype=torch.uint8)
    k, v = tile.k_codes.to(torch.uint8), tile.v_codes.to(torch.uint8)
    if int(v.max()) > layout.v_levels:
        raise ValueError(f"value code {int(v.max())} in a tile of {layout.v_bits}-bit values")
    _section(raw, layout, "k_codes")[:] = (k[:, 0::2] | k[:, 1::2] << 4).reshape(-1)
    low = v & 3
    v_bytes = low[:, 0::4] | low[:, 1::4] << 2 | low[:, 2::4] << 4 | low[:, 3::4] << 6
    _section(raw, layout, "v_codes")[:] = v_bytes.reshape(-1)
    if layout.v_bits == 3:
        high = (v >> 2).reshape(layout.tokens, -1, 8)
        planes = sum(high[..., i] << i for i in range(8))
        _section(raw, layout, "v_high")[:] = planes.reshape(-1)
    for name in FP16_SECTIONS:
        _section(raw, layout, name)[:] = getattr(tile, name).to(torch.float16).view(torch.uint8)
    return raw


def unpack_tile(raw: torch.Tensor, layout: TileLayout) -> QuantizedTile:
    """A tile's bytes (uint8 [tile_bytes], e.g. pool[block, head]) back to numbers."""
    t, d = layout.tokens, layout.head_dim
    k_bytes = _section(raw, layout, "k_codes").reshape(t, d // 2).to(torch.int64)
    v_bytes = _section(raw, layout, "v_codes").reshape(t, d // 4).to(torch.int64)
    k_codes = torch.stack((k_bytes & 15, k_bytes >> 4), dim=2).reshape(t, d)
    v_codes = torch.stack([(v_bytes >> (2 * i)) & 3 for i in range(4)], dim=2).reshape(t, d)
    if layout.v_bits == 3:
        planes = _section(raw, layout, "v_high").reshape(t, d // 8).to(torch.int64)
        high = torch.stack([(planes >> i) & 1 for i in range(8)], dim=2).reshape(t, d)
        v_codes = v_codes | high << 2
    numbers = {
        name: _section(raw, layout, name).clone().view(torch.float16).to(torch.float64)
        for name in FP16_SECTIONS
    }
    return QuantizedTile(k_codes=k_codes, v_codes=v_codes, **numbers)

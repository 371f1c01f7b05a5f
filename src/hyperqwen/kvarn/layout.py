"""KVarN's packed tile: one KV head's 128 tokens of K and V as one run of bytes.

A layer's pool is uint8 [num_blocks, num_kv_heads, tile_bytes]: a vLLM block of 128 tokens is
one tile per KV head, and a page (one block of one layer) is num_kv_heads * tile_bytes bytes,
which is `block_size * num_kv_heads * slot_bytes` with slot_bytes = tile_bytes / 128: the
budget vLLM 0.26's TQFullAttentionSpec (v1/kv_cache_interface.py) already computes from its
`tq_slot_size` for TurboQuant's uint8 pages, so a later KVarN backend can declare its pages the
same way and return this shape from `get_kv_cache_shape`. Unlike TurboQuant's per-token slots,
a tile is written whole, once its 128 tokens are all there (store.py), because the key grid
is per channel over the tile's tokens.

Sections of a tile, in order, each starting on a 16-byte boundary (vector loads), the tile
padded to a whole number of bytes per token. Codes are token-major; packing is little-end
first: a K byte holds channels 2b (low nibble) and 2b + 1, a V byte channels 4b (lowest two
bits) to 4b + 3. Scales, zeros and token scales are fp16 (quantize.py says what they mean).

    k_codes        [T, D/2] uint8   4-bit key codes, per-channel grid
    k_scale        [D] fp16         key grid step per channel
    k_zero         [D] fp16         key grid zero per channel
    k_token_scale  [T] fp16         r, the key normalisation per token
    v_codes        [T, D/4] uint8   2-bit value codes (the low two bits of 3-bit ones),
                                    per-token grid
    v_scale        [T] fp16         value grid step per token
    v_zero         [T] fp16         value grid zero per token
    v_high         [T, D/8] uint8   3-bit values only (`v_bits=3`, else 0 bytes): bit 2 of
                                    each value code, channel 8b + i in bit i

Values take 2 bits (the default, issue 25's format) or 3 (the KVARN_V_BITS knob). The third
bit is a plane of its own, last, so a 3-bit tile is the 2-bit tile with v_high appended: every
other section keeps its offset, and a reader of the low two bits is the 2-bit one.

The 16-bit parts of a sequence (its first 128 tokens, the attention sink, and its newest,
still-filling tile) are not in the pool: the table below counts them as two bf16 tiles per
sequence and KV head, spread over the context. The module appends both tables (sections,
bytes per token) to this docstring when imported, so `help()` shows the code's numbers, not
typed ones; `python -m hyperqwen.kvarn.layout` prints them (the sections of a 3-bit tile; the
2-bit tile is the same without v_high).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch

TILE_TOKENS = 128
K_BITS, V_BITS = 4, 2  # bits per key and value code (values: V_BITS_CHOICES)
SECTION_ALIGN = 16
FP16_SECTIONS = ("k_scale", "k_zero", "k_token_scale", "v_scale", "v_zero")
KV_HEADS_27B, FULL_ATTENTION_LAYERS_27B, HEAD_DIM_27B = 4, 16, 256
TABLE_CONTEXTS = (4096, 32768, 114688)  # 114688 = 112k, issue 25's decode-tax context
V_BITS_CHOICES = (2, 3)  # bits per value code a tile can store


class SectionOffsets(NamedTuple):
    """Byte offsets of a tile's sections; the kernels take it as one constexpr (AT.k_scale)."""

    k_codes: int
    k_scale: int
    k_zero: int
    k_token_scale: int
    v_codes: int
    v_scale: int
    v_zero: int
    v_high: int


def check_power_of_two(n: int, *, minimum: int = 1, what: str = "head_dim") -> None:
    if n < minimum or n & (n - 1):
        raise ValueError(f"{what}={n}: the Hadamard rotation needs a power of two >= {minimum}")


@dataclass(frozen=True)
class TileLayout:
    head_dim: int = HEAD_DIM_27B
    tokens: int = TILE_TOKENS
    v_bits: int = V_BITS

    def __post_init__(self) -> None:
        check_power_of_two(self.head_dim, minimum=16)
        check_power_of_two(self.tokens, minimum=16, what="tile tokens")
        if self.v_bits not in V_BITS_CHOICES:
            raise ValueError(
                f"v_bits={self.v_bits!r}: a KVarN tile stores values in "
                f"{' or '.join(map(str, V_BITS_CHOICES))} bits"
            )

    @property
    def v_levels(self) -> int:
        """The highest value code: the kernels' V_LEVELS, quantize.py's v_levels."""
        return 2**self.v_bits - 1

    @cached_property
    def sections(self) -> dict[str, tuple[int, int]]:
        """Section name -> (byte offset in the tile, byte size)."""
        t, d = self.tokens, self.head_dim
        high = t * d // 8 if self.v_bits == 3 else 0
        sizes = {"k_codes": t * d // 2, "k_scale": 2 * d, "k_zero": 2 * d, "k_token_scale": 2 * t,
                 "v_codes": t * d // 4, "v_scale": 2 * t, "v_zero": 2 * t,
                 "v_high": high}  # fmt: skip
        assert tuple(sizes) == SectionOffsets._fields
        offsets, at = {}, 0
        for name, size in sizes.items():
            offsets[name] = (at, size)
            at = math.ceil((at + size) / SECTION_ALIGN) * SECTION_ALIGN
        return offsets

    @cached_property
    def tile_bytes(self) -> int:
        end = max(offset + size for offset, size in self.sections.values())
        return math.ceil(end / self.tokens) * self.tokens

    @property
    def slot_bytes(self) -> int:
        """Bytes per token and KV head: a vLLM page is block_size * num_kv_heads of these."""
        return self.tile_bytes // self.tokens

    def pool_shape(self, num_blocks: int, num_kv_heads: int) -> tuple[int, int, int]:
        return (num_blocks, num_kv_heads, self.tile_bytes)

    @property
    def offsets(self) -> SectionOffsets:
        return SectionOffsets(*(offset for offset, _ in self.sections.values()))

    def check_pool(self, pool: torch.Tensor) -> None:
        import torch  # here, not at the top: capacity's arithmetic imports this module

        if (
            pool.dtype != torch.uint8
            or pool.dim() != 3
            or pool.shape[2] != self.tile_bytes
            or pool.stride(2) != 1
        ):
            raise ValueError(
                f"a KVarN pool for head_dim {self.head_dim} is uint8 [num_blocks, num_kv_heads, "
                f"{self.tile_bytes}] with contiguous tiles ({self.v_bits}-bit values); got "
                f"{pool.dtype} {list(pool.shape)} stride {pool.stride()}"
            )


def bytes_per_token(layout: TileLayout, context: int | None = None) -> float:
    """K and V bytes per token, one KV head of one layer. With a context length: also the
    sequence's two bf16 tiles (sink and filling), and its whole last page, spread over it."""
    if context is None:
        return float(layout.slot_bytes)
    pages = math.ceil(context / layout.tokens) * layout.tile_bytes
    return (pages + 2 * layout.tokens * bf16_bytes_per_token(layout.head_dim)) / context


def bf16_bytes_per_token(head_dim: int) -> int:
    return 2 * head_dim * 2


def fp8_bytes_per_token(head_dim: int) -> int:
    return 2 * head_dim  # vLLM's fp8 cache: one byte per element, per-layer scales only


def bytes_table(head_dim: int = HEAD_DIM_27B) -> str:
    """Markdown: bytes per token against bf16 and fp8, per KV head and for the 27B's 16
    full-attention layers of 4 KV heads each, for each choice of value bits."""
    d = head_dim
    per_model = KV_HEADS_27B * FULL_ATTENTION_LAYERS_27B
    rows = [("bf16", bf16_bytes_per_token(d)), ("fp8", fp8_bytes_per_token(d))]
    for v_bits in V_BITS_CHOICES:
        layout = TileLayout(head_dim=d, v_bits=v_bits)
        name = f"KVarN, {v_bits}-bit V"
        rows.append((f"{name}: tiles (pool only)", bytes_per_token(layout)))
        rows += [
            (f"{name}, at {n} tokens, 16-bit sink + filling tile", bytes_per_token(layout, n))
            for n in TABLE_CONTEXTS
        ]
    lines = [f"| head_dim {d} | bytes/token/KV head | vs bf16 | vs fp8 | 27B KiB/token |",
             "|---|---:|---:|---:|---:|"]  # fmt: skip
    for name, b in rows:
        lines.append(
            f"| {name} | {b:.1f} | {b / bf16_bytes_per_token(d):.3f} | "
            f"{b / fp8_bytes_per_token(d):.3f} | {b * per_model / 1024:.2f} |"
        )
    return "\n".join(lines)


def sections_table(layout: TileLayout | None = None) -> str:
    """Markdown: the sections a tile has (none of 0 bytes), by default a 3-bit tile's."""
    layout = layout or TileLayout(v_bits=3)
    lines = [f"| section (head_dim {layout.head_dim}, {layout.v_bits}-bit V) | offset | bytes |",
             "|---|---:|---:|"]  # fmt: skip
    lines += [
        f"| {name} | {offset} | {size} |"
        for name, (offset, size) in layout.sections.items()
        if size
    ]
    lines.append(f"| tile ({layout.slot_bytes} per token) | | {layout.tile_bytes} |")
    return "\n".join(lines)


__doc__ = f"{__doc__}\n{sections_table()}\n\n{bytes_table()}\n"

if __name__ == "__main__":
    print(sections_table(), bytes_table(), sep="\n\n")

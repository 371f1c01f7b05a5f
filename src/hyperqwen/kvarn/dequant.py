"""The dequantize kernel: KVarN tiles of a pool back to bf16 K and V.

One program per (tile, KV head) reads pool[block_ids[i], head] (layout.py), decodes it as
quantize.dequantize_rotated does (K = r·(q·s + z), V = q·s + z) and writes [128, D] rows of K
and V, in the model's basis (rotated back, the default) or left in the rotated basis
(`unrotate=False`: a reader that rotates its query instead). The attention kernels
(decode.py, prefill.py) do not use it: they dequantize in registers with the code unpackers
below and never write a tile out.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hyperqwen.kvarn.hadamard import hadamard_chunk_into, hadamard_chunks_done
from hyperqwen.kvarn.layout import TileLayout
from hyperqwen.kvarn.store import (
    SIXTEEN_BIT,
    check_block_ids,
    check_tiles,
    fp16_section,
    program_tile,
)

# fp32 for readers that keep the decoded tile unrounded (the tests)
OUT_DTYPES = (*SIXTEEN_BIT, torch.float32)


@triton.jit
def k_codes(tile, rows, first, ROWS: tl.constexpr, WIDTH: tl.constexpr, AT: tl.constexpr,
            D: tl.constexpr):  # fmt: skip
    """The 4-bit key codes of channels first .. first + WIDTH - 1 of `rows` ([ROWS, 1]) of a
    tile, int32 [ROWS, WIDTH]; first a multiple of 2."""
    columns = first // 2 + tl.arange(0, WIDTH // 2)[None, :]
    packed = tl.load(tile + AT.k_codes + rows * (D // 2) + columns).to(tl.int32)
    return tl.reshape(tl.join(packed & 15, packed >> 4), (ROWS, WIDTH))


@triton.jit
def v_codes(tile, rows, first, ROWS: tl.constexpr, WIDTH: tl.constexpr, AT: tl.constexpr,
            D: tl.constexpr, V_LEVELS: tl.constexpr):  # fmt: skip
    """As k_codes for the value codes, 2-bit (V_LEVELS 3) or 3-bit (7: the low two bits as
    2-bit ones, bit 2 from the v_high plane, layout.py); first a multiple of 4 (of 8 for
    3-bit codes)."""
    columns = first // 4 + tl.arange(0, WIDTH // 4)[None, :]
    packed = tl.load(tile + AT.v_codes + rows * (D // 4) + columns).to(tl.int32)
    # channel 4b + 2j + i sits at bits 2(2j + i); joining the i = 0 and i = 1 pairs last
    # puts i innermost
    evens = tl.join(packed & 3, (packed >> 4) & 3)
    odds = tl.join((packed >> 2) & 3, (packed >> 6) & 3)
    codes = tl.reshape(tl.join(evens, odds), (ROWS, WIDTH))
    if V_LEVELS > 3:  # a constexpr branch: 2-bit tiles compile without it
        planes = first // 8 + tl.arange(0, WIDTH // 8)[None, :]
        high = tl.load(tile + AT.v_high + rows * (D // 8) + planes).to(tl.int32)
        bits = (high[:, :, None] >> tl.arange(0, 8)[None, None, :]) & 1  # channel 8b + i
        codes += tl.reshape(bits, (ROWS, WIDTH)) << 2
    return codes


@triton.jit
def _keys(tile, rows, first, ROWS: tl.constexpr, WIDTH: tl.constexpr, AT: tl.constexpr,
          D: tl.constexpr):  # fmt: skip
    """r·(q·s + z) of those channels, fp32 [ROWS, WIDTH], in the rotated basis."""
    channels = first + tl.arange(0, WIDTH)[None, :]
    scale = tl.load(fp16_section(tile, AT.k_scale) + channels).to(tl.float32)
    zero = tl.load(fp16_section(tile, AT.k_zero) + channels).to(tl.float32)
    r = tl.load(fp16_section(tile, AT.k_token_scale) + rows).to(tl.float32)
    q = k_codes(tile, rows, first, ROWS, WIDTH, AT, D).to(tl.float32)
    return r * (q * scale + zero)


@triton.jit
def _values(tile, rows, first, ROWS: tl.constexpr, WIDTH: tl.constexpr, AT: tl.constexpr,
            D: tl.constexpr, V_LEVELS: tl.constexpr):  # fmt: skip
    """q·s + z of those channels, fp32 [ROWS, WIDTH], in the rotated basis."""
    scale = tl.load(fp16_section(tile, AT.v_scale) + rows).to(tl.float32)
    zero = tl.load(fp16_section(tile, AT.v_zero) + rows).to(tl.float32)
    codes = v_codes(tile, rows, first, ROWS, WIDTH, AT, D, V_LEVELS)
    return codes.to(tl.float32) * scale + zero


@triton.jit
def _decoded(tile, rows, IS_KEY: tl.constexpr, T: tl.constexpr, D: tl.constexpr,
             AT: tl.constexpr, V_LEVELS: tl.constexpr, UNROTATE: tl.constexpr):  # fmt: skip
    """A tile's keys or values, fp32 [T, D]; rotated back 16 channels at a time (hadamard.py:
    one dot over the whole tile would need more shared memory than sm86 has)."""
    if UNROTATE:
        acc = tl.zeros((T, D // 16, 16), tl.float32)
        for first in range(0, D, 16):
            if IS_KEY:
                chunk = _keys(tile, rows, first, T, 16, AT, D)
            else:
                chunk = _values(tile, rows, first, T, 16, AT, D, V_LEVELS)
            acc = hadamard_chunk_into(acc, chunk, first, D)
        out = hadamard_chunks_done(acc, D)
    elif IS_KEY:
        out = _keys(tile, rows, 0, T, D, AT, D)
    else:
        out = _values(tile, rows, 0, T, D, AT, D, V_LEVELS)
    return out


@triton.jit
def _dequant_kernel(pool_ptr, block_ids_ptr, k_ptr, v_ptr,
                    stride_kn, stride_kt, stride_kh, stride_vn, stride_vt, stride_vh,
                    stride_block, stride_head,
                    T: tl.constexpr, D: tl.constexpr, AT: tl.constexpr,
                    V_LEVELS: tl.constexpr, UNROTATE: tl.constexpr):  # fmt: skip
    index, head, tile = program_tile(pool_ptr, block_ids_ptr, stride_block, stride_head)
    rows = tl.arange(0, T)[:, None].to(tl.int64)
    d = tl.arange(0, D)[None, :]
    k = _decoded(tile, rows, True, T, D, AT, V_LEVELS, UNROTATE)
    k_dst = k_ptr + index.to(tl.int64) * stride_kn + head.to(tl.int64) * stride_kh
    tl.store(k_dst + rows * stride_kt + d, k.to(k_ptr.dtype.element_ty))
    v = _decoded(tile, rows, False, T, D, AT, V_LEVELS, UNROTATE)
    v_dst = v_ptr + index.to(tl.int64) * stride_vn + head.to(tl.int64) * stride_vh
    tl.store(v_dst + rows * stride_vt + d, v.to(v_ptr.dtype.element_ty))


def dequantize_tiles(
    pool: torch.Tensor,
    block_ids: torch.Tensor,
    layout: TileLayout,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    unrotate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of pool[block_ids[i], :], each [n, 128, num_kv_heads, D] (bf16 unless `out`
    gives bf16, fp16 or fp32 tensors of that shape, contiguous along D)."""
    layout.check_pool(pool)
    shape = (block_ids.shape[0], layout.tokens, pool.shape[1], layout.head_dim)
    check_block_ids(block_ids, pool, shape[0])
    if out is None:
        out = tuple(torch.empty(shape, dtype=torch.bfloat16, device=pool.device) for _ in range(2))
    k, v = out
    check_tiles("out[0] (K)", k, shape, OUT_DTYPES)
    check_tiles("out[1] (V)", v, shape, OUT_DTYPES)
    if shape[0]:
        _dequant_kernel[(shape[0], pool.shape[1])](
            pool, block_ids, k, v,
            *k.stride()[:3], *v.stride()[:3],
            pool.stride(0), pool.stride(1),
            T=layout.tokens, D=layout.head_dim, AT=layout.offsets, V_LEVELS=layout.v_levels,
            UNROTATE=unrotate,
            num_warps=8,
        )  # fmt: skip
    return k, v

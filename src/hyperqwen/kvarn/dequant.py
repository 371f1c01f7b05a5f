"""The dequantize kernel: KVarN tiles of a pool back to bf16 K and V.

One program per (tile, KV head) reads pool[block_ids[i], head] (layout.py), decodes it as
quantize.dequantize_rotated does (K = r·(q·s + z), V = q·s + z) and writes [128, D] rows of K
and V, in the model's basis (rotated back, the default: prefill attention with a plain query,
and the tests) or left in the rotated basis (`unrotate=False`: a reader that rotates its
query instead). The fused split-K decode kernel will read tiles the same way without
writing them out.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hyperqwen.kvarn.hadamard import hadamard_rows
from hyperqwen.kvarn.layout import TileLayout
from hyperqwen.kvarn.store import check_block_ids, check_tiles, fp16_section, program_tile


@triton.jit
def _dequant_kernel(pool_ptr, block_ids_ptr, k_ptr, v_ptr,
                    stride_kn, stride_kt, stride_kh, stride_vn, stride_vt, stride_vh,
                    stride_block, stride_head,
                    T: tl.constexpr, D: tl.constexpr, AT: tl.constexpr,
                    UNROTATE: tl.constexpr):  # fmt: skip
    index, head, tile = program_tile(pool_ptr, block_ids_ptr, stride_block, stride_head)
    t = tl.arange(0, T)
    d = tl.arange(0, D)
    rows = t[:, None].to(tl.int64)

    packed = tl.load(tile + AT.k_codes + rows * (D // 2) + tl.arange(0, D // 2)[None, :]).to(
        tl.int32
    )
    q = tl.reshape(tl.join(packed & 15, packed >> 4), (T, D)).to(tl.float32)
    k_scale = tl.load(fp16_section(tile, AT.k_scale) + d[None, :]).to(tl.float32)
    k_zero = tl.load(fp16_section(tile, AT.k_zero) + d[None, :]).to(tl.float32)
    r = tl.load(fp16_section(tile, AT.k_token_scale) + t[:, None]).to(tl.float32)
    k = r * (q * k_scale + k_zero)
    if UNROTATE:
        k = hadamard_rows(k, T, D)
    k_dst = k_ptr + index.to(tl.int64) * stride_kn + head.to(tl.int64) * stride_kh
    tl.store(k_dst + rows * stride_kt + d[None, :], k.to(k_ptr.dtype.element_ty))

    packed = tl.load(tile + AT.v_codes + rows * (D // 4) + tl.arange(0, D // 4)[None, :]).to(
        tl.int32
    )
    # channel 4b + 2j + i sits at bits 2(2j + i); joining the i = 0 and i = 1 pairs last
    # puts i innermost
    evens = tl.join(packed & 3, (packed >> 4) & 3)
    odds = tl.join((packed >> 2) & 3, (packed >> 6) & 3)
    q = tl.reshape(tl.join(evens, odds), (T, D)).to(tl.float32)
    v_scale = tl.load(fp16_section(tile, AT.v_scale) + t[:, None]).to(tl.float32)
    v_zero = tl.load(fp16_section(tile, AT.v_zero) + t[:, None]).to(tl.float32)
    v = q * v_scale + v_zero
    if UNROTATE:
        v = hadamard_rows(v, T, D)
    v_dst = v_ptr + index.to(tl.int64) * stride_vn + head.to(tl.int64) * stride_vh
    tl.store(v_dst + rows * stride_vt + d[None, :], v.to(v_ptr.dtype.element_ty))


def dequantize_tiles(
    pool: torch.Tensor,
    block_ids: torch.Tensor,
    layout: TileLayout,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    unrotate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of pool[block_ids[i], :], each [n, 128, num_kv_heads, D] (bf16 unless `out`
    gives bf16 or fp16 tensors of that shape, contiguous along D)."""
    layout.check_pool(pool)
    shape = (block_ids.shape[0], layout.tokens, pool.shape[1], layout.head_dim)
    check_block_ids(block_ids, pool, shape[0])
    if out is None:
        out = tuple(torch.empty(shape, dtype=torch.bfloat16, device=pool.device) for _ in range(2))
    k, v = out
    check_tiles("out[0] (K)", k, shape)
    check_tiles("out[1] (V)", v, shape)
    if shape[0]:
        _dequant_kernel[(shape[0], pool.shape[1])](
            pool, block_ids, k, v,
            *k.stride()[:3], *v.stride()[:3],
            pool.stride(0), pool.stride(1),
            T=layout.tokens, D=layout.head_dim, AT=layout.offsets, UNROTATE=unrotate,
            num_warps=8,
        )  # fmt: skip
    return k, v

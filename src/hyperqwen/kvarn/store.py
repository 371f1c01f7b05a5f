"""The store kernel: whole 128-token tiles of K and V quantized into a KVarN pool.

One program per (tile, KV head) reads the tile's K and V [128, D] (bf16 or fp16, any token and
head strides), rotates them, runs quantize.py's encoding in fp32 and writes the packed tile of
layout.py into pool[block_ids[i], head]. It writes those bytes and nothing else: no zeroing
of a block it is not told about, so a block another request shares under prefix caching is
never touched, and every write lands in a block named by the caller in the same launch (no
deferred flush that could reach a page after it was recycled). Pool addresses are computed in
int64: a 27B layer's pool of 4 KV heads passes 2^31 bytes at about 20k blocks (2.6M tokens).

Arithmetic: divisions and square roots are the correctly rounded ones (`div_rn`, `sqrt_rn`)
and the launch turns off FMA contraction (EXACT_ARITHMETIC), so each elementwise step rounds
as IEEE fp32 does, which is what the Triton interpreter computes on the CPU: Triton's `/` and
`tl.sqrt` compile to approximate `div.full.f32` (2 ulp) and `sqrt.approx.ftz.f32`, and ptxas
fuses multiply-adds. Only the summation order of `tl.sum` still differs between the two.
Where quantize.py (float64) and this kernel (fp32) decide a value lying within float error of
a grid midpoint or an fp16 rounding boundary, they may take different branches: a code flips
and the least-squares refit then moves the group's grid by several fp16 steps. The tests
(tests/kvarn_encoding.py) demand exact agreement away from such ties and, near them, a valid
encoding of the reference's quality.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hyperqwen.kvarn import quantize
from hyperqwen.kvarn.hadamard import hadamard_chunk_into, hadamard_chunks_done
from hyperqwen.kvarn.layout import TileLayout

# how many channels (keys) or tokens (values) the store quantizes at a time
K_COLUMNS, V_ROWS = 64, 32
STORE_WARPS = 8
# compile options of the launch (fit.py compiles with them too): no multiply-add contraction
EXACT_ARITHMETIC = {"enable_fp_fusion": False}


@triton.jit
def program_tile(pool_ptr, block_ids_ptr, stride_block, stride_head):
    """(index, head, first byte of pool[block_ids[index], head]) of a program of a
    (tiles, KV heads) grid; the address in int64."""
    index = tl.program_id(0)
    head = tl.program_id(1)
    block = tl.load(block_ids_ptr + index).to(tl.int64)
    return index, head, pool_ptr + block * stride_block + head.to(tl.int64) * stride_head


@triton.jit
def fp16_section(tile, AT: tl.constexpr):
    return (tile + AT).to(tl.pointer_type(tl.float16))


@triton.jit
def _rotated_rows(src, rows, stride_t, first_out, T: tl.constexpr, D: tl.constexpr,
                  OUT: tl.constexpr):  # fmt: skip
    """Columns first_out .. first_out + OUT - 1 of rows src[rows * stride_t, :D] times
    H_D / sqrt(D), fp32 [T, OUT], read 16 columns at a time (hadamard.py: a whole-tile dot
    would need more shared memory than sm86 has)."""
    acc = tl.zeros((T, OUT // 16, 16), tl.float32)
    for first in range(0, D, 16):
        chunk = tl.load(src + rows * stride_t + first + tl.arange(0, 16)[None, :])
        acc = hadamard_chunk_into(acc, chunk.to(tl.float32), first, D, first_out)
    return hadamard_chunks_done(acc, D)


@triton.jit
def _grid_codes(y, scale, zero, LEVELS: tl.constexpr):
    q = tl.floor(tl.math.div_rn(y - zero, scale) + 0.5)
    return tl.minimum(tl.maximum(q, 0.0), LEVELS)


@triton.jit
def _fit_grid(y, LEVELS: tl.constexpr, AXIS: tl.constexpr, GROUP: tl.constexpr,
              ROUNDS: tl.constexpr, MIN_STEP: tl.constexpr):  # fmt: skip
    """quantize.fit_grid: scale and zero of each group along AXIS, fp16-rounded, keep_dims."""
    zero = tl.min(y, axis=AXIS, keep_dims=True)
    scale = tl.maximum(tl.math.div_rn(tl.max(y, axis=AXIS, keep_dims=True) - zero, LEVELS * 1.0),
                       MIN_STEP)  # fmt: skip
    for _ in tl.static_range(ROUNDS):
        q = _grid_codes(y, scale, zero, LEVELS)
        q_mean = tl.math.div_rn(tl.sum(q, axis=AXIS, keep_dims=True), GROUP * 1.0)
        y_mean = tl.math.div_rn(tl.sum(y, axis=AXIS, keep_dims=True), GROUP * 1.0)
        q_dev = q - q_mean
        var = tl.math.div_rn(tl.sum(q_dev * q_dev, axis=AXIS, keep_dims=True), GROUP * 1.0)
        cov = tl.math.div_rn(tl.sum(q_dev * (y - y_mean), axis=AXIS, keep_dims=True), GROUP * 1.0)
        fitted = tl.math.div_rn(cov, tl.where(var > 0, var, 1.0))
        scale = tl.where(var > 0, tl.maximum(fitted, MIN_STEP), scale)
        zero = tl.where(var > 0, y_mean - fitted * q_mean, zero)
    scale = tl.maximum(scale, MIN_STEP).to(tl.float16).to(tl.float32)
    return scale, zero.to(tl.float16).to(tl.float32)


@triton.jit
def _store_kernel(k_ptr, v_ptr, pool_ptr, block_ids_ptr, tile_ids_ptr,
                  stride_kn, stride_kt, stride_kh, stride_vn, stride_vt, stride_vh,
                  stride_block, stride_head,
                  T: tl.constexpr, D: tl.constexpr, AT: tl.constexpr,
                  K_LEVELS: tl.constexpr, V_LEVELS: tl.constexpr,
                  BALANCE_ROUNDS: tl.constexpr, GRID_ROUNDS: tl.constexpr,
                  MIN_SCALE: tl.constexpr, MIN_STEP: tl.constexpr,
                  K_COLUMNS: tl.constexpr, V_ROWS: tl.constexpr):  # fmt: skip
    if tl.load(block_ids_ptr + tl.program_id(0)) < 0:  # a candidate the device did not fill
        return
    index, head, tile = program_tile(pool_ptr, block_ids_ptr, stride_block, stride_head)
    source = tl.load(tile_ids_ptr + index).to(tl.int64)  # which of k and v's tiles
    t = tl.arange(0, T)
    rows = t[:, None].to(tl.int64)

    # keys: rotate, normalise tokens (quantize.balance_token_scales), per-channel 4-bit grid,
    # K_COLUMNS channels at a time (each channel's grid is its own; the token scales sum over
    # all of them first): the whole tile at once spills registers
    k_src = k_ptr + source * stride_kn + head.to(tl.int64) * stride_kh
    r = tl.full((T, 1), 1.0, tl.float32)
    for _ in tl.static_range(BALANCE_ROUNDS):
        sums = tl.zeros((T, 1), tl.float32)
        for first in range(0, D, K_COLUMNS):
            x = _rotated_rows(k_src, rows, stride_kt, first, T, D, K_COLUMNS)
            xr = tl.math.div_rn(x, r)
            squares = tl.math.div_rn(tl.sum(xr * xr, axis=0, keep_dims=True), T * 1.0)
            c = tl.maximum(tl.math.sqrt_rn(squares), MIN_SCALE)
            xc = tl.math.div_rn(x, c)
            sums += tl.sum(xc * xc, axis=1, keep_dims=True)
        r = tl.maximum(tl.math.sqrt_rn(tl.math.div_rn(sums, D * 1.0)), MIN_SCALE)
    r = r.to(tl.float16).to(tl.float32)
    tl.store(fp16_section(tile, AT.k_token_scale) + t[:, None], r.to(tl.float16))
    half = tl.arange(0, K_COLUMNS // 2)[None, :]
    for first in range(0, D, K_COLUMNS):
        y = tl.math.div_rn(_rotated_rows(k_src, rows, stride_kt, first, T, D, K_COLUMNS), r)
        k_scale, k_zero = _fit_grid(y, K_LEVELS, 0, T, GRID_ROUNDS, MIN_STEP)
        q = _grid_codes(y, k_scale, k_zero, K_LEVELS).to(tl.int32)
        even, odd = tl.split(tl.reshape(q, (T, K_COLUMNS // 2, 2)))
        packed = (even | (odd << 4)).to(tl.uint8)
        tl.store(tile + AT.k_codes + rows * (D // 2) + first // 2 + half, packed)
        channels = first + tl.arange(0, K_COLUMNS)[None, :]
        tl.store(fp16_section(tile, AT.k_scale) + channels, k_scale.to(tl.float16))
        tl.store(fp16_section(tile, AT.k_zero) + channels, k_zero.to(tl.float16))

    # values: rotate, per-token 2- or 3-bit grid (V_LEVELS 3 or 7), V_ROWS tokens at a time (a
    # token's grid is its own; a whole tile at once needs twice the registers and spills)
    v_src = v_ptr + source * stride_vn + head.to(tl.int64) * stride_vh
    quarter = tl.arange(0, D // 4)
    for first in range(0, T, V_ROWS):
        tokens = first + tl.arange(0, V_ROWS)[:, None]
        rotated = _rotated_rows(v_src, tokens.to(tl.int64), stride_vt, 0, V_ROWS, D, D)
        v_scale, v_zero = _fit_grid(rotated, V_LEVELS, 1, D, GRID_ROUNDS, MIN_STEP)
        codes = _grid_codes(rotated, v_scale, v_zero, V_LEVELS).to(tl.int32)
        if V_LEVELS > 3:  # 3-bit codes: bit 2 into its plane (layout.py), the rest as 2-bit
            high = tl.reshape(codes >> 2, (V_ROWS, D // 8, 8))  # channel 8b + i at bit i
            planes = tl.sum(high << tl.arange(0, 8)[None, None, :], axis=2)
            eighth = tl.arange(0, D // 8)[None, :]
            tl.store(tile + AT.v_high + tokens * (D // 8) + eighth, planes.to(tl.uint8))
            codes = codes & 3
        pairs_02, pairs_13 = tl.split(
            tl.reshape(codes, (V_ROWS, D // 4, 2, 2))
        )  # channel 4b + 2j + i
        q0, q2 = tl.split(pairs_02)
        q1, q3 = tl.split(pairs_13)
        packed = q0 | (q1 << 2) | (q2 << 4) | (q3 << 6)
        tl.store(tile + AT.v_codes + tokens * (D // 4) + quarter[None, :], packed.to(tl.uint8))
        tl.store(fp16_section(tile, AT.v_scale) + tokens, v_scale.to(tl.float16))
        tl.store(fp16_section(tile, AT.v_zero) + tokens, v_zero.to(tl.float16))


SIXTEEN_BIT = (torch.bfloat16, torch.float16)
SHORT_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def check_tiles(name: str, part: torch.Tensor, shape: tuple[int, ...], dtypes=SIXTEEN_BIT) -> None:
    """K or V tiles [tiles, tokens, KV heads, head_dim] as the kernels take them."""
    fits = part.shape == shape and part.dtype in dtypes
    if not fits or part.stride(3) != 1:
        allowed = " or ".join(SHORT_NAMES[t] for t in dtypes)
        raise ValueError(
            f"{name} must be {allowed} {list(shape)} (tiles, tokens, KV heads of the pool, "
            f"head_dim) contiguous along head_dim; got {part.dtype} {list(part.shape)} stride "
            f"{part.stride()}"
        )


def check_block_ids(block_ids: torch.Tensor, pool: torch.Tensor, tiles: int) -> None:
    if block_ids.dtype not in (torch.int32, torch.int64) or block_ids.shape != (tiles,):
        raise ValueError(
            f"block_ids must be int32 or int64 [{tiles}] (one pool block per tile); got "
            f"{block_ids.dtype} {list(block_ids.shape)}"
        )
    if block_ids.device != pool.device:
        raise ValueError(f"block_ids are on {block_ids.device}, the pool on {pool.device}")


def store_tiles(
    key: torch.Tensor,
    value: torch.Tensor,
    pool: torch.Tensor,
    block_ids: torch.Tensor,
    layout: TileLayout | None = None,
    tile_ids: torch.Tensor | None = None,
) -> None:
    """Quantize tiles key/value [n, 128, num_kv_heads, D] (bf16 or fp16, contiguous along D)
    into pool[block_ids[i], :] (layout.py), every KV head of each: tile i, or tile
    tile_ids[i] where given (the backend passes its whole side cache and the slots, so that
    no copy of the tiles is made and a launch of a fixed size can carry padding). Block ids
    must name blocks of the pool, or be negative: that entry is skipped (the backend decides
    on the device which of a step's candidate tiles it filled, and pads the list to a length
    a CUDA graph can keep, kvarn/backend.py); the kernel does not check them otherwise (a
    GPU-side check would cost a sync)."""
    layout = layout or TileLayout(head_dim=key.shape[-1])
    layout.check_pool(pool)
    expected = (key.shape[0], layout.tokens, pool.shape[1], layout.head_dim)
    check_tiles("key", key, expected)
    check_tiles("value", value, expected)
    count = key.shape[0] if tile_ids is None else block_ids.shape[0]
    check_block_ids(block_ids, pool, count)
    if tile_ids is None:
        tile_ids = torch.arange(count, device=pool.device)
    elif tile_ids.dtype not in (torch.int32, torch.int64) or tile_ids.shape != (count,):
        raise ValueError(
            f"tile_ids must be int32 or int64 [{count}] (one tile of key and value per block "
            f"id); got {tile_ids.dtype} {list(tile_ids.shape)}"
        )
    if count == 0:
        return
    _store_kernel[(count, pool.shape[1])](
        key, value, pool, block_ids, tile_ids,
        *key.stride()[:3], *value.stride()[:3],
        pool.stride(0), pool.stride(1),
        T=layout.tokens, D=layout.head_dim, AT=layout.offsets,
        K_LEVELS=quantize.K_LEVELS, V_LEVELS=layout.v_levels,
        BALANCE_ROUNDS=quantize.BALANCE_ROUNDS, GRID_ROUNDS=quantize.GRID_ROUNDS,
        MIN_SCALE=quantize.MIN_SCALE, MIN_STEP=quantize.MIN_STEP,
        K_COLUMNS=min(K_COLUMNS, layout.head_dim), V_ROWS=V_ROWS,
        num_warps=STORE_WARPS, **EXACT_ARITHMETIC,
    )  # fmt: skip

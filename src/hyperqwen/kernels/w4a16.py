"""Skinny W4A16 GEMM: y = x @ dequant(W)ᵀ for the few rows of a decode or verify step.

Status: correct; on the H200 level with vLLM's Marlin over the 27B body at M = 1 and 7 %
slower at M = 4 (kernels/README.md); LINEAR_BACKEND=hyperqwen serves vLLM's W4A16 layers with it
(engine/w4a16_linear.py; off by default). `hyperqwen bench kernels` times it beside vLLM's
kernels so each change is measured against them.

Reads the compressed-tensors pack-quantized weights (G = 128) with each group's codes reordered
once by repack_pairs and moved into tiles by tile_rows, the one copy a layer would then keep:

  checkpoint     [N, K / 8]  int32    eight 4-bit codes per word along K, code j at bits 4j..4j+3
  weight_packed  [N, K / 8]  int32    repack_pairs(checkpoint): word i of a group holds columns
                                      32j + 2i (nibble j) and 32j + 2i + 1 (nibble j + 4), j < 4
  weight_scale   [N, K / G]  x.dtype  one scale per output row and group of G inputs
  value          (code - 8) * scale   (symmetric uint4b8)

The layer keeps those words and scales in tiles (tile_rows): [N / 16, K / G, 16, 16] words and
[N / 16, K / G, 16] scales, so one group of 16 rows is 1 KB in a run and a 16-row slab's groups
follow each other; a program streams BLOCK_N / 16 runs of (its K slice / G) KB. (Kept in rows,
[N, K / 8], a program's load of one group was BLOCK_N pieces of 64 bytes a row apart: 2-9 %
slower at every 27B shape at M = 1 and 4 on the H200, kernels/README.md.)

Each program owns BLOCK_N output rows and one of SPLIT_K slices of K, and takes one group of G
inputs at a time. The codes, OR-ed into the mantissa of a float constant (MAGIC + code, exact, no
int-to-float conversion) with the bias subtracted in x's dtype (exact), meet xᵀ in tensor-core
dots (M padded to 16) as 4 pair planes: one shift and mask give two codes, 4 dots of K = 32
against contiguous x; the group scale multiplies the small [BLOCK_N, M] product. (Two other
unpacks of the checkpoint's own order, in K order and as 8 nibble planes of K = 16, lost to this
one at every 27B shape on the H200 and are gone: kernels/README.md.) Where N and K are whole
tiles (every 27B shape) the weight loads carry no masks.
A work item is one output tile's slice of K: either each program takes one (a grid of them
all), or (TileConfig.programs_per_sm) a persistent grid of a few programs per SM walks them in
one flattened loop, so the next item's loads can start while one finishes and no part-full last
wave of short programs remains.
Split-K partial sums go to an fp32 workspace; the last program of an output tile to arrive (an
acq_rel counter) adds the slices in slice order, so results do not depend on arrival order,
writes the output and re-arms the counter for the next launch (CUDA-graph replays reuse it).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hyperqwen.kernels.pdl import (
    launch_with_pdl,
    prefetch_to_l2,
    release_dependents,
    wait_for_producers,
)

# Triton 3.6's interpreter multiplies bf16 dot operands as raw bits; under it the dot runs in
# fp32 (exact for these operands), so CPU tests check the same arithmetic.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DOT_MIN_ROWS = 16  # tl.dot's smallest M/N/K
MAX_BLOCK_M = 64  # the automatic block_m's largest; a config may ask for up to LARGEST_BLOCK_M
LARGEST_BLOCK_M = 256
PAIR_GROUP = 128  # the pair-plane layout's group: 16 words, 4 pair planes of K = 32
TILE_ROWS = 16  # the tiled order's slab: 16 rows of one group are 1 KB in a run
_SLAB = tl.constexpr(TILE_ROWS)  # the same, as the kernel reads a global
# bit patterns of the floats whose mantissas take a 4-bit code exactly (_magic)
_BF16_MAGIC, _FP16_MAGIC = tl.constexpr(0x4300), tl.constexpr(0x6400)


def _lop3_into_magic(bits: int) -> tl.constexpr:
    """PTX for (word & 0x000F000F) | the magic's bits in both halves, in one LOP3."""
    return tl.constexpr(f"lop3.b32 $0, $1, 0x000F000F, {bits | bits << 16:#010x}, 0xEA;")


_LOP3_BF16, _LOP3_FP16 = _lop3_into_magic(_BF16_MAGIC.value), _lop3_into_magic(_FP16_MAGIC.value)


@dataclass(frozen=True)
class TileConfig:
    """One launch shape of the kernel."""

    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 3
    # > 0: a persistent grid of this many programs per SM walks the work items; 0: one
    # program per work item
    programs_per_sm: int = 0
    # rows of x per program; 0: M rounded up to a power of two, 16 to MAX_BLOCK_M
    block_m: int = 0

    def label(self) -> str:
        persistent = f"_r{self.programs_per_sm}" if self.programs_per_sm else ""
        rows = f"_m{self.block_m}" if self.block_m else ""
        return (
            f"n{self.block_n}_k{self.block_k}_s{self.split_k}_w{self.num_warps}_p{self.num_stages}"
            f"{persistent}{rows}"
        )


@triton.jit
def _magic(x_ptr):
    """(bit pattern, value) of the float whose mantissa takes a 4-bit code exactly, in x's dtype:
    bf16 0x4300 = 128.0, fp16 0x6400 = 1024.0."""
    if x_ptr.dtype.element_ty == tl.bfloat16:
        return _BF16_MAGIC, 128.0
    else:
        return _FP16_MAGIC, 1024.0


@triton.jit
def _as_x_dtype(bits, x_ptr):
    """int32 holding a 16-bit pattern -> that pattern as x's float dtype."""
    return bits.to(tl.int16).to(x_ptr.dtype.element_ty, bitcast=True)


@triton.jit
def _unbiased_dot(biased, x_t, part, x_ptr, DOT_IN_FP32: tl.constexpr):
    """part + (biased - (MAGIC + 8)) @ x_t: biased holds MAGIC + code in x's dtype, so the
    subtraction gives the weights -8..7 exactly (in fp32 under the interpreter)."""
    _, value = _magic(x_ptr)
    if DOT_IN_FP32:
        weights = biased.to(tl.float32) - (value + 8.0)
        return tl.dot(weights, x_t.to(tl.float32), part, input_precision="ieee")
    else:
        weights = (biased - (value + 8.0)).to(x_ptr.dtype.element_ty)  # exact in bf16/fp16
        return tl.dot(weights, x_t, part)


@triton.jit
def _mask_into_magic(shifted, x_ptr):
    """(shifted & 0x000F000F) | the magic float's bits in both halves, as one LOP3: written in
    Triton, both constants are immediates and ptxas needs two (sm90 SASS: 434 instructions per
    loop step at 64 rows / 4 warps, 371 with this)."""
    if x_ptr.dtype.element_ty == tl.bfloat16:
        return tl.inline_asm_elementwise(
            _LOP3_BF16, "=r,r", [shifted], dtype=tl.int32, is_pure=True, pack=1
        )
    else:
        return tl.inline_asm_elementwise(
            _LOP3_FP16, "=r,r", [shifted], dtype=tl.int32, is_pure=True, pack=1
        )


@triton.jit
def _pair_dot(words, j: tl.constexpr, x_j, part, x_ptr, DOT_IN_FP32: tl.constexpr):
    """Pair plane j: one shift and mask turn nibbles j and j + 4 of every word into two codes,
    OR-ed into the mantissas of two magic floats at once; the halves are the pair's two k."""
    shifted = words >> (4 * j) if j else words
    if DOT_IN_FP32:  # the interpreter runs no PTX: the same bits from two operations
        bits, _ = _magic(x_ptr)
        pairs = (shifted & 0x000F000F) | (bits | (bits << 16))
    else:
        pairs = _mask_into_magic(shifted, x_ptr)
    low = _as_x_dtype(pairs, x_ptr)  # the int16 cast keeps the low half
    high = _as_x_dtype(pairs >> 16, x_ptr)
    biased = tl.interleave(low, high)  # k = 2i from word i's low half, 2i + 1 from its high
    return _unbiased_dot(biased, x_j.T, part, x_ptr, DOT_IN_FP32)


@triton.jit
def _plane_inputs(x_rows, k0, m_mask, K, EVEN: tl.constexpr):
    """x[:, k0 : k0 + 32], one pair plane's inputs, as a load of its own: split out of one
    [M, 128] load in registers, x was re-laid out through shared memory on the wgmma tiles (2-byte
    loads and stores, 64 per thread per K block in sm90 SASS); loaded alone it goes by cp.async
    straight to where the dot reads it."""
    offs_k = k0 + tl.arange(0, 32)
    mask = m_mask[:, None] if EVEN else m_mask[:, None] & (offs_k[None, :] < K)
    return tl.load(x_rows + offs_k[None, :], mask=mask, other=0.0)


@triton.jit
def _work_item(
    pid_n, pid_k, pid_m, n_tiles, x_ptr, w_ptr, s_ptr, out_ptr, partial_ptr, counter_ptr, M, N, K,
    groups_per_row, stride_xm, stride_om, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    DOT_IN_FP32: tl.constexpr, EVEN: tl.constexpr, RELEASE: tl.constexpr,
):  # fmt: skip
    """One output tile's slice of K: its dots, then its store or its part of the split-K sum;
    RELEASE: the next kernel may launch once the dots are done (PDL)."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < M
    # int64 slab offsets: N * K / 8 words exceeds 2**31 for a full-vocabulary head. The group
    # count comes in as an argument so Triton sees its divisibility and vectorizes the loads.
    GROUPS_PER_BLOCK: tl.constexpr = BLOCK_K // GROUP
    WORDS: tl.constexpr = GROUP // 8
    # slab n // 16 holds its groups one after another, each as 16 rows x 16 words
    slab = (offs_n // _SLAB).to(tl.int64)
    within = offs_n % _SLAB
    w_rows = w_ptr + (slab * (groups_per_row * _SLAB * WORDS) + within * WORDS)[:, None]
    s_rows = s_ptr + (slab * (groups_per_row * _SLAB) + within)[:, None]
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm

    k_blocks = tl.cdiv(K, BLOCK_K)
    blocks_per_split = tl.cdiv(k_blocks, SPLIT_K)
    first_block = pid_k * blocks_per_split
    last_block = tl.minimum(first_block + blocks_per_split, k_blocks)

    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for block in range(first_block, last_block):
        for g in tl.static_range(GROUPS_PER_BLOCK):
            group = block * GROUPS_PER_BLOCK + g
            offs_w = group * (_SLAB * WORDS) + tl.arange(0, WORDS)
            if EVEN:
                words = tl.load(w_rows + offs_w[None, :])
                scale = tl.load(s_rows + group * _SLAB)
            else:
                group_mask = n_mask[:, None] & (group * GROUP < K)
                words = tl.load(w_rows + offs_w[None, :], mask=group_mask, other=0)
                scale = tl.load(s_rows + group * _SLAB, mask=group_mask, other=0.0)
            # pair plane j: nibbles j and j + 4 of word i hold k = 32j + 2i and 32j + 2i + 1
            part = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for j in tl.static_range(4):
                x_j = _plane_inputs(x_rows, group * GROUP + 32 * j, m_mask, K, EVEN)
                part = _pair_dot(words, j, x_j, part, x_ptr, DOT_IN_FP32)
            acc += part * scale.to(tl.float32)
    release_dependents(RELEASE)

    out_ptrs = out_ptr + offs_m.to(tl.int64)[None, :] * stride_om + offs_n[:, None]
    out_mask = n_mask[:, None] & m_mask[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tile = pid_m * n_tiles + pid_n
        tile_elems: tl.constexpr = BLOCK_N * BLOCK_M
        tile_offs = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        slice_base = partial_ptr + tile.to(tl.int64) * (SPLIT_K * tile_elems)
        tl.store(slice_base + pid_k * tile_elems + tile_offs, acc)
        arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for piece in tl.static_range(SPLIT_K):
                total += tl.load(slice_base + piece * tile_elems + tile_offs, cache_modifier=".cg")
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(counter_ptr + tile, 0, sem="relaxed", scope="gpu")


@triton.jit
def _prefetch_weights(
    pid_n, pid_k, w_ptr, s_ptr, N, K, groups_per_row, GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """With PDL, before the wait: ask L2 for one work item's words and scales, which no kernel
    writes. In tiles each 16-row slab's groups of the item's K slice are one run of each."""
    if PDL:
        k_blocks = tl.cdiv(K, BLOCK_K)
        groups_per_split = tl.cdiv(k_blocks, SPLIT_K) * (BLOCK_K // GROUP)
        first = pid_k * groups_per_split
        groups = tl.minimum(first + groups_per_split, groups_per_row) - first
        if groups > 0:
            for s in tl.static_range(BLOCK_N // _SLAB):
                slab = pid_n * (BLOCK_N // _SLAB) + s
                if slab * _SLAB < N:
                    run = slab.to(tl.int64) * groups_per_row + first
                    words: tl.constexpr = _SLAB * GROUP // 8
                    prefetch_to_l2(w_ptr + run * words, groups * words, PDL)
                    prefetch_to_l2(s_ptr + run * _SLAB, groups * _SLAB, PDL)


@triton.jit
def _w4a16_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    partial_ptr,
    counter_ptr,
    M,
    N,
    K,
    groups_per_row,
    stride_xm,
    stride_om,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    EVEN: tl.constexpr,  # N and K are whole tiles: no masks on the weight loads
    PERSISTENT: tl.constexpr,  # a few programs per SM walk the work items; else one each
    PDL: tl.constexpr,  # launched with programmatic dependent launch (kernels/pdl.py)
):
    n_tiles = tl.cdiv(N, BLOCK_N)
    m_tiles = tl.cdiv(M, BLOCK_M)
    # Tiles along M come first in the launch order, so the programs running at once share their
    # weight tiles through L2 and a weight byte leaves DRAM about once however large M is.
    if PERSISTENT:
        # work items (tile along M, tile along N, slice of K), walked by a grid of a few
        # programs per SM; flattened, the loop can prefetch the next item's first blocks while
        # this one finishes, and no last wave runs part-full
        items = m_tiles * n_tiles * SPLIT_K
        first = tl.program_id(0)
        _prefetch_weights(
            (first // m_tiles) % n_tiles, first // (m_tiles * n_tiles), w_ptr, s_ptr, N, K,
            groups_per_row, GROUP, BLOCK_N, BLOCK_K, SPLIT_K, PDL,
        )  # fmt: skip
        wait_for_producers(PDL)  # x, and the split-K workspace the last launch used
        for item in tl.range(tl.program_id(0), items, tl.num_programs(0), flatten=True):
            _work_item(
                (item // m_tiles) % n_tiles, item // (m_tiles * n_tiles), item % m_tiles, n_tiles,
                x_ptr, w_ptr, s_ptr, out_ptr, partial_ptr, counter_ptr, M, N, K, groups_per_row,
                stride_xm, stride_om, GROUP, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K,
                DOT_IN_FP32, EVEN, False,
            )  # fmt: skip
        release_dependents(PDL)  # after every item: a waiting program would take an SM slot
    else:
        _prefetch_weights(
            tl.program_id(1), tl.program_id(2), w_ptr, s_ptr, N, K, groups_per_row, GROUP,
            BLOCK_N, BLOCK_K, SPLIT_K, PDL,
        )  # fmt: skip
        wait_for_producers(PDL)
        _work_item(
            tl.program_id(1), tl.program_id(2), tl.program_id(0), n_tiles, x_ptr, w_ptr, s_ptr,
            out_ptr, partial_ptr, counter_ptr, M, N, K, groups_per_row, stride_xm,
            stride_om, GROUP, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, DOT_IN_FP32, EVEN, PDL,
        )  # fmt: skip


class SplitWorkspace:
    """Per-device fp32 partial sums and arrival counters shared by every split-K launch.

    Launches on one stream run one after another, so one buffer serves all layers. `reserve`
    grows it ahead of CUDA-graph capture; a launch that finds it too small while a graph is
    being captured fails instead of allocating inside the graph.
    """

    def __init__(self) -> None:
        self._partials: dict[torch.device, torch.Tensor] = {}
        self._counters: dict[torch.device, torch.Tensor] = {}

    def reserve(self, device: torch.device, partial_elems: int, tiles: int) -> None:
        partials = self._partials.get(device)
        if partials is None or partials.numel() < partial_elems:
            self._partials[device] = torch.empty(partial_elems, dtype=torch.float32, device=device)
        counters = self._counters.get(device)
        if counters is None or counters.numel() < tiles:
            # zeros: every launch leaves its counters at zero again
            self._counters[device] = torch.zeros(tiles, dtype=torch.int32, device=device)

    def get(
        self, device: torch.device, partial_elems: int, tiles: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        partials = self._partials.get(device)
        counters = self._counters.get(device)
        if (
            partials is None
            or counters is None
            or partials.numel() < partial_elems
            or counters.numel() < tiles
        ):
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "hyperqwen w4a16: split-K workspace too small during CUDA-graph capture "
                    f"(needs {partial_elems} partial sums, {tiles} counters); call "
                    "WORKSPACE.reserve(device, *workspace_size(m, n, config)) before capture"
                )
            self.reserve(device, partial_elems, tiles)
            partials, counters = self._partials[device], self._counters[device]
        return partials, counters


WORKSPACE = SplitWorkspace()
INTERPRETER_SMS = 2  # under the interpreter a persistent grid walks several items per program


@functools.cache
def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def _launch_geometry(m: int, n: int, config: TileConfig) -> tuple[int, int, int]:
    """(BLOCK_M, tiles along N, tiles along M) for a launch of `config` on m rows."""
    block_m = config.block_m or min(max(DOT_MIN_ROWS, triton.next_power_of_2(m)), MAX_BLOCK_M)
    return block_m, triton.cdiv(n, config.block_n), triton.cdiv(m, block_m)


def workspace_size(m: int, n: int, config: TileConfig) -> tuple[int, int]:
    """(fp32 partial sums, counters) a split-K launch of `config` needs; (0, 0) without split."""
    if config.split_k == 1:
        return 0, 0
    block_m, n_tiles, m_tiles = _launch_geometry(m, n, config)
    tiles = n_tiles * m_tiles
    return tiles * config.split_k * config.block_n * block_m, tiles


def kernel_constants(config: TileConfig, block_m: int, even: bool, pdl: bool = False) -> dict:
    """The kernel's compile-time arguments for a launch of `config` (also what `hyperqwen bench
    sass` compiles): GROUP is the pair layout's, which check_config requires."""
    return {
        "GROUP": PAIR_GROUP,
        "BLOCK_M": block_m,
        "BLOCK_N": config.block_n,
        "BLOCK_K": config.block_k,
        "SPLIT_K": config.split_k,
        "DOT_IN_FP32": _INTERPRETED,
        "EVEN": even,
        "PERSISTENT": config.programs_per_sm > 0,
        "PDL": pdl,
    }


def check_config(config: TileConfig, group_size: int, k: int) -> None:
    """Refuse a config or shape the kernel cannot run, with the reason."""
    problems = []
    if group_size != PAIR_GROUP:
        problems.append(f"group_size={group_size}: the pair-plane layout takes {PAIR_GROUP}")
    elif config.block_k % group_size:
        problems.append(f"block_k={config.block_k} must be a multiple of group_size={group_size}")
    if k % group_size:
        problems.append(f"K={k} must be a multiple of group_size={group_size}")
    if config.block_n < DOT_MIN_ROWS or config.block_n & (config.block_n - 1):
        problems.append(f"block_n={config.block_n} must be a power of two >= {DOT_MIN_ROWS}")
    if config.split_k < 1:
        problems.append(f"split_k={config.split_k} must be >= 1")
    if config.block_m and (
        config.block_m < DOT_MIN_ROWS
        or config.block_m > LARGEST_BLOCK_M
        or config.block_m & (config.block_m - 1)
    ):
        problems.append(
            f"block_m={config.block_m} must be 0 (from M) or a power of two from "
            f"{DOT_MIN_ROWS} to {LARGEST_BLOCK_M}"
        )
    if config.programs_per_sm < 0:
        problems.append(f"programs_per_sm={config.programs_per_sm} must be >= 0")
    if problems:
        raise ValueError("w4a16 tile config " + config.label() + ": " + "; ".join(problems))


def w4a16_matmul(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    group_size: int,
    config: TileConfig,
    out: torch.Tensor | None = None,
    pdl: bool | None = None,
) -> torch.Tensor:
    """x [M, K] (bf16/fp16, rows contiguous) times dequantized weights [N, K]ᵀ -> [M, N];
    weight_packed and weight_scale in tiles (tile_rows of the pair-plane words, repack_pairs).
    pdl: programmatic dependent launch (kernels/pdl.py); None: as the PDL knob decides."""
    m, k = x.shape
    n = weight_packed.shape[0] * TILE_ROWS
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"x must be bfloat16 or float16, got {x.dtype}")
    groups = k // group_size
    words_shape = (n // TILE_ROWS, groups, TILE_ROWS, group_size // 8)
    scale_shape = (n // TILE_ROWS, groups, TILE_ROWS)
    if tuple(weight_packed.shape) != words_shape or weight_packed.dtype != torch.int32:
        raise ValueError(
            f"weight_packed must be int32 tiles [N/16, K/G, 16, G/8] = {list(words_shape)}, got "
            f"{weight_packed.dtype} {list(weight_packed.shape)} (tile_rows makes them)"
        )
    if tuple(weight_scale.shape) != scale_shape or weight_scale.dtype != x.dtype:
        raise ValueError(
            f"weight_scale must be {x.dtype} tiles [N/16, K/G, 16] = {list(scale_shape)}, got "
            f"{weight_scale.dtype} {list(weight_scale.shape)} (tile_rows makes them)"
        )
    if x.stride(1) != 1 or not weight_packed.is_contiguous() or not weight_scale.is_contiguous():
        raise ValueError("x rows and both weight tensors must be contiguous")
    check_config(config, group_size, k)
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_m, n_tiles, m_tiles = _launch_geometry(m, n, config)
    partial_elems, tiles = workspace_size(m, n, config)
    if tiles:
        partials, counters = WORKSPACE.get(x.device, partial_elems, tiles)
    else:
        partials, counters = out, weight_packed  # not touched without split-K
    if config.programs_per_sm:
        items = n_tiles * config.split_k * m_tiles
        grid = (min(items, sm_count(x.device) * config.programs_per_sm), 1, 1)
    else:
        grid = (m_tiles, n_tiles, config.split_k)
    pdl = launch_with_pdl(x.device, pdl)
    _w4a16_kernel[grid](
        x,
        weight_packed,
        weight_scale,
        out,
        partials,
        counters,
        m,
        n,
        k,
        k // group_size,
        x.stride(0),
        out.stride(0),
        **kernel_constants(
            config, block_m, even=n % config.block_n == 0 and k % config.block_k == 0, pdl=pdl
        ),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        launch_pdl=pdl,
    )
    return out


def pack_codes(codes: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """Codes [N, K] of `bits` bits -> int32 [N, K * bits / 32], code j of a word at bits
    j * bits (the checkpoint's pack-quantized order, 4-bit body and 8-bit heads alike)."""
    n, k = codes.shape
    per_word = 32 // bits
    shifts = torch.arange(per_word, dtype=torch.int64, device=codes.device) * bits
    words = (codes.to(torch.int64).reshape(n, k // per_word, per_word) << shifts).sum(dim=-1)
    return (words - ((words >= 2**31).to(torch.int64) << 32)).to(torch.int32)


def pair_plane_order(k: int) -> torch.Tensor:
    """The checkpoint column each stored code position takes in the pair-plane layout: in each
    group of 128, word i's nibble j (j < 4) holds column 32j + 2i and nibble j + 4 column
    32j + 2i + 1 (position 8i + j of the packed row, as pack_codes orders them)."""
    word = torch.arange(PAIR_GROUP // 8)[:, None]
    nibble = torch.arange(8)[None, :]
    within = 32 * (nibble % 4) + 2 * word + nibble // 4  # [16 words, 8 nibbles]
    groups = torch.arange(k // PAIR_GROUP)[:, None] * PAIR_GROUP
    return (groups + within.reshape(1, -1)).reshape(-1)


def repack_pairs(weight_packed: torch.Tensor) -> torch.Tensor:
    """Checkpoint-order int4 words [N, K/8] -> the same codes in the pair-plane layout
    w4a16_matmul reads, same shape and dtype: what a layer would keep instead, not beside."""
    codes = unpack_codes(weight_packed)
    order = pair_plane_order(codes.shape[1]).to(codes.device)
    return pack_codes(codes[:, order])


def tile_rows(
    weight_packed: torch.Tensor, weight_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pair-plane words [N, K/8] and scales [N, K/G] (G = 128) in rows -> the same in tiles:
    [N/16, K/G, 16, 16] words and [N/16, K/G, 16] scales, slab by slab, group by group. N must
    be a multiple of 16 (every 27B projection and head is)."""
    n, words = weight_packed.shape
    groups = weight_scale.shape[1]
    if n % TILE_ROWS or words != groups * (PAIR_GROUP // 8):
        raise ValueError(
            f"tile_rows: N={n} must be a multiple of {TILE_ROWS} and the words [N, K/8] must "
            f"hold {groups} groups of {PAIR_GROUP} (got {words} words per row)"
        )
    slabs = n // TILE_ROWS
    tiled_words = weight_packed.reshape(slabs, TILE_ROWS, groups, PAIR_GROUP // 8)
    tiled_scales = weight_scale.reshape(slabs, TILE_ROWS, groups)
    return tiled_words.transpose(1, 2).contiguous(), tiled_scales.transpose(1, 2).contiguous()


def tiles_from_checkpoint(
    weight_packed: torch.Tensor, weight_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A checkpoint's words [N, K/8] and scales [N, K/G] -> the tiles w4a16_matmul reads
    (tile_rows of repack_pairs): what a layer keeps instead of them."""
    return tile_rows(repack_pairs(weight_packed), weight_scale)


def unpack_codes(weight_packed: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """The inverse of pack_codes: int32 [N, K * bits / 32] -> int64 codes [N, K]."""
    per_word = 32 // bits
    shifts = torch.arange(per_word, dtype=torch.int64, device=weight_packed.device) * bits
    words = weight_packed.to(torch.int64) & 0xFFFFFFFF
    codes = (words[:, :, None] >> shifts) & ((1 << bits) - 1)
    return codes.reshape(weight_packed.shape[0], -1)

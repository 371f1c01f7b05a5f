"""A Gated DeltaNet layer's b and a projections for the few rows of a decode or verify step.

vLLM 0.26's Qwen3.5 GDN layer runs `in_proj_ba` (bf16, [2H, hidden]: b's H rows, then a's) as
one GEMM, splits its [T, 2H] output and copies b and a out contiguous. In the shipped single
profile's step on the H200 the one dense GEMM launched once per GDN layer (cuBLAS's
nvjet_sm90_tst_64x8_64x16 split-K kernel, 48 launches per step, 1 MB of weights each) took
4.9 us a launch, 0.24 ms of a 27B MTP step (docs/results/2026-12-01-h200-27b-single-overlap.json,
patched side's profile).
Here one program per weight row streams that row against the step's few rows of x and writes
its column of b or a, both contiguous, in one launch.

Status: correct against float64 (tests/test_kernel_ba_proj.py, CPU interpreter); compiles for
sm86 and sm90 here without spills; not timed.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from hyperqwen.kernels.pdl import (
    launch_with_pdl,
    prefetch_to_l2,
    release_dependents,
    wait_for_producers,
)

MAX_ROWS = 16  # rows of x it takes: decode and verify steps; prefill keeps vLLM's GEMM
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _ba_kernel(x_ptr, w_ptr, b_ptr, a_ptr, M, K, H, stride_xm, stride_wn,
               BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    row = tl.program_id(0)  # weight row: b's column `row` below H, else a's column row - H
    rows_m = tl.arange(0, BLOCK_M)
    m_mask = rows_m < M
    acc = tl.zeros((BLOCK_M,), dtype=tl.float32)
    w_row = w_ptr + row.to(tl.int64) * stride_wn
    prefetch_to_l2(w_row, K, PDL)  # the weight row, while the kernel before still runs
    wait_for_producers(PDL)  # x is the previous kernel's output
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        w = tl.load(w_row + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        x = tl.load(
            x_ptr + rows_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(x * w[None, :], axis=1)
    release_dependents(PDL)
    value = acc.to(b_ptr.dtype.element_ty)
    if row < H:
        tl.store(b_ptr + rows_m * H + row, value, mask=m_mask)
    else:
        tl.store(a_ptr + rows_m * H + (row - H), value, mask=m_mask)


def runs_here(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel takes these: at most MAX_ROWS rows with contiguous columns, a
    contiguous [2H, K] weight of x's dtype, on a GPU (or under Triton's CPU interpreter)."""
    return (
        (x.is_cuda or _INTERPRETED)
        and x.dim() == 2
        and 0 < x.shape[0] <= MAX_ROWS
        and x.stride(1) == 1
        and weight.dim() == 2
        and weight.is_contiguous()
        and weight.shape[0] % 2 == 0
        and weight.shape[1] == x.shape[1]
        and weight.dtype == x.dtype
    )


def ba_projection(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    pdl: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] against weight [2H, K] (b's rows, then a's) -> (b [M, H], a [M, H]), both
    contiguous, in x's dtype, accumulated in fp32; into `out` where given. pdl: programmatic
    dependent launch (kernels/pdl.py); None: as the PDL knob decides for the card."""
    if not runs_here(x, weight):
        raise ValueError(
            f"ba_projection takes 1-{MAX_ROWS} rows x [M, K] with contiguous columns and a "
            f"contiguous [2H, K] weight of x's dtype; got x {x.dtype} {list(x.shape)} stride "
            f"{x.stride()}, weight {weight.dtype} {list(weight.shape)}"
        )
    m, k = x.shape
    heads = weight.shape[0] // 2
    if out is None:
        out = tuple(torch.empty((m, heads), dtype=x.dtype, device=x.device) for _ in range(2))
    b, a = out
    for part in out:
        if part.shape != (m, heads) or part.dtype != x.dtype or not part.is_contiguous():
            raise ValueError(f"out must be two contiguous {x.dtype} [{m}, {heads}] tensors")
    block_m = triton.next_power_of_2(m)
    # [BLOCK_M, BLOCK_K] fp32 products per program: 4096 elements (32 registers a thread)
    block_k = min(triton.next_power_of_2(k), max(256, 4096 // block_m))
    pdl = launch_with_pdl(x.device, pdl)
    _ba_kernel[(2 * heads,)](
        x, weight, b, a, m, k, heads, x.stride(0), weight.stride(0),
        BLOCK_M=block_m, BLOCK_K=block_k, PDL=pdl, num_warps=4, num_stages=3, launch_pdl=pdl,
    )  # fmt: skip
    return b, a

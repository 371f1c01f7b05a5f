"""Split a Gated DeltaNet layer's packed q|k|v rows into one buffer of contiguous q, k and v.

vLLM 0.26's GDN layer (`rearrange_mixed_qkv`) gives its recurrent kernels q, k and v as three
contiguous tensors cut from the rows [T, q_dim + k_dim + v_dim] of its projection: three
reshape copies (rows are strided once T > 1) and a torch.cat, in every GDN layer of every step.
The H200 profile of a 27B MTP step (docs/results/2026-12-01-h200-27b-single-vs-stock-mtp-nopc
.json) counts 144 copy kernels per step, 3 per GDN layer, 0.32 ms of a 10 ms step: those
copies, as far as the call sites show (the trace's kernel names do not say). This is one
launch: each program copies a block of columns of one row (all in one part) to where they go in

  out = [q of every row | k of every row | v of every row]   (T * q_dim + T * k_dim + T * v_dim)

which is exactly the buffer vLLM's torch.cat builds, so its views follow unchanged (an
engine feature serves it: engine/README.md's feature table). Rows may have any stride (they
are a column slice of the projection's output); columns must be contiguous.

Status: exact against vLLM's torch.cat (tests/test_kernel_split_qkv.py, CPU interpreter);
compiles for sm80/86/89/90/120 here (Triton 3.6, PTX: 16-byte vector loads and stores), so
every card takes it; its tests passed compiled on the H200 (2026-12-01, 26 passed); not timed.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from hyperqwen.kernels.pdl import launch_with_pdl, release_dependents, wait_for_producers

MAX_BLOCK = 1024
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit(do_not_specialize=["rows"])  # one compile for every row count
def _split_rows_kernel(src, out, rows, row_stride, Q: tl.constexpr, K: tl.constexpr,
                       V: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    # BLOCK divides Q, K and V, so a program's columns lie in one part: its destination is one
    # contiguous run (vector stores)
    row = tl.program_id(0).to(tl.int64)
    rows = rows.to(tl.int64)  # T * (q_dim + k_dim) may pass 2**31 elements
    first = tl.program_id(1) * BLOCK
    if first >= Q + K:
        start = rows * (Q + K) + row * V + (first - Q - K)
    elif first >= Q:
        start = rows * Q + row * K + (first - Q)
    else:
        start = row * Q + first
    columns = tl.arange(0, BLOCK)
    wait_for_producers(PDL)  # no weights: only the index arithmetic comes before
    values = tl.load(src + row * row_stride + first + columns)
    release_dependents(PDL)
    tl.store(out + start + columns, values)


def block_for(*widths: int) -> int:
    """The largest power of two up to MAX_BLOCK that divides every width."""
    block = MAX_BLOCK
    while any(width % block for width in widths):
        block //= 2
    return block


def runs_here(mixed: torch.Tensor) -> bool:
    """Whether the kernel takes this tensor: on a GPU (or under Triton's CPU interpreter), 2-D
    with contiguous columns."""
    return (mixed.is_cuda or _INTERPRETED) and mixed.dim() == 2 and mixed.stride(1) == 1


def split_qkv(
    mixed: torch.Tensor,
    q_dim: int,
    k_dim: int,
    v_dim: int,
    out: torch.Tensor | None = None,
    pdl: bool | None = None,
) -> torch.Tensor:
    """The flat [T*q_dim + T*k_dim + T*v_dim] buffer of mixed's q, k and v parts (mixed is
    [T, q_dim + k_dim + v_dim], rows strided, columns contiguous); into `out` if given. pdl:
    programmatic dependent launch (kernels/pdl.py); None: as the PDL knob decides for the card."""
    rows, width = mixed.shape
    if width != q_dim + k_dim + v_dim or mixed.stride(1) != 1:
        raise ValueError(
            f"split_qkv: rows of {width} columns (stride {mixed.stride(1)}) for parts "
            f"{q_dim}+{k_dim}+{v_dim}; need exactly those, contiguous"
        )
    if out is None:
        out = torch.empty(rows * width, dtype=mixed.dtype, device=mixed.device)
    elif out.shape != (rows * width,) or out.dtype != mixed.dtype or not out.is_contiguous():
        raise ValueError(f"split_qkv: out must be contiguous [{rows * width}] {mixed.dtype}")
    if rows:
        block = block_for(q_dim, k_dim, v_dim)
        grid = (rows, width // block)
        pdl = launch_with_pdl(mixed.device, pdl)
        _split_rows_kernel[grid](
            mixed, out, rows, mixed.stride(0), q_dim, k_dim, v_dim, block, pdl, launch_pdl=pdl
        )
    return out

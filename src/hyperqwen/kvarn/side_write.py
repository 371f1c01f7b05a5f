"""A step's new K and V rows into the side cache (Triton), and its launcher: one launch for
both, where two advanced-index assignments took two launches and their host work per layer
(every attention layer in each verify pass, and eagerly in each drafter pass, which vLLM runs
outside CUDA graphs)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def write_side_rows(side_key: torch.Tensor, side_value: torch.Tensor, rows: torch.Tensor,
                    key: torch.Tensor, value: torch.Tensor) -> None:  # fmt: skip
    """side_key[rows[i]] = key[i] and side_value[rows[i]] = value[i] for i < n: key and value
    [n, Hkv, D] (any row stride, e.g. column slices of a fused qkv projection; contiguous
    per row), the side tensors [rows, Hkv, D] contiguous, rows int64 [n] within them (the
    backend's side_rows). Each value is cast to the side cache's dtype."""
    n = rows.shape[0]
    if key.shape != value.shape or key.shape[0] != n or key.dim() != 3:
        raise ValueError(
            f"key and value must both be [{n}, Hkv, D]; got {list(key.shape)} and "
            f"{list(value.shape)}"
        )
    if side_key.shape[1:] != key.shape[1:] or side_value.shape != side_key.shape:
        raise ValueError(
            f"the side cache must be [rows, {key.shape[1]}, {key.shape[2]}] for K and V; got "
            f"{list(side_key.shape)} and {list(side_value.shape)}"
        )
    for name, tensor in (("key", key), ("value", value)):
        heads_apart = tensor.shape[1] == 1 or tensor.stride(1) == tensor.shape[2]
        if tensor.stride(2) != 1 or not heads_apart:
            raise ValueError(f"{name} must be contiguous within a row; stride {tensor.stride()}")
    if not (side_key.is_contiguous() and side_value.is_contiguous()):
        raise ValueError("the side cache's K and V must be contiguous")
    if rows.dtype != torch.int64:
        raise ValueError(f"rows must be int64; got {rows.dtype}")
    if n == 0:
        return
    width = key.shape[1] * key.shape[2]
    _side_write_kernel[(n,)](
        key, value, rows, side_key, side_value, key.stride(0), value.stride(0),
        WIDTH=width, BLOCK=triton.next_power_of_2(width),
    )  # fmt: skip


@triton.jit
def _side_write_kernel(key_ptr, value_ptr, rows_ptr, side_k_ptr, side_v_ptr,
                       stride_kt, stride_vt, WIDTH: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    token = tl.program_id(0)
    row = tl.load(rows_ptr + token)
    i = tl.arange(0, BLOCK)
    inside = i < WIDTH
    key = tl.load(key_ptr + token.to(tl.int64) * stride_kt + i, mask=inside)
    value = tl.load(value_ptr + token.to(tl.int64) * stride_vt + i, mask=inside)
    target = row * WIDTH + i
    tl.store(side_k_ptr + target, key.to(side_k_ptr.dtype.element_ty), mask=inside)
    tl.store(side_v_ptr + target, value.to(side_v_ptr.dtype.element_ty), mask=inside)

"""The normalised Walsh-Hadamard rotation KVarN applies along head_dim.

H_n is Sylvester's ±1 matrix, H_n[i, j] = (-1)^popcount(i & j), divided by sqrt(n): symmetric
and orthogonal, so it is its own inverse. KVarN stores K·H and V·H; at read time the query is
rotated too, (q·H)·(k·H) = q·k, and the attention output comes out rotated, o·H, which one more
rotation returns to the model's basis. The rotation spreads a channel's outliers evenly over
all n channels (every |H_ij| is the same), which is what a per-token 2-bit grid for V needs,
and turns a few spiky entries of one key into a token-wide magnitude that KVarN's per-token
key scale then takes out (quantize.py).

Two forms: `rotate_reference` (torch, any dtype, the O(n log n) butterfly) and, for kernels,
`hadamard_rows` (Triton, [ROWS, N] -> [ROWS, N] in fp32). Up to N = 128 the latter is one dot
with the whole ±1 matrix, built in registers from the index bits; from 256 on it uses
H_{16m} = H_16 ⊗ H_m (index d = m·a + b splits into its high part a and low part b, and
popcount parity splits the same way): two dots with 16- and m-wide factors instead of one with
an n-wide matrix, 16 + m multiply-adds per element instead of n. `rotate_rows` launches it on the
rows of a 2-D tensor (queries at read time, and the tests).

A dot stages its operands in shared memory, so `hadamard_rows` on a whole 128-token tile of
head_dim 256 needs 128 KB of it, more than the 99 KB a block gets on sm86/sm89 (RTX 3090/4090).
Kernels that rotate whole tiles use `hadamard_chunk_into` instead: the caller feeds the input 16
columns at a time (loaded or decoded from memory), each chunk goes through one dot with H_16
(with the same split of the index, low part 16 wide: H_N[i, j] = H_{N/16}[i // 16, j // 16] ·
H_16[i % 16, j % 16]) and is added into the [ROWS, N/16, 16] result with the signs of its row
of H_{N/16}: shared memory for one [ROWS, 16] chunk, 16 + N/16 multiply-adds per element. It
can also build only a group of output columns, for kernels that hold a group at a time.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from hyperqwen.kvarn.layout import check_power_of_two


def hadamard_matrix(n: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Sylvester's H_n / sqrt(n) as a dense [n, n] matrix (the definition the tests use)."""
    check_power_of_two(n)
    index = torch.arange(n)
    bits = torch.bitwise_and(index[:, None], index[None, :])
    parity = torch.zeros_like(bits)
    while bits.any():
        parity ^= bits & 1
        bits >>= 1
    return (1 - 2 * parity).to(dtype) / math.sqrt(n)


def rotate_reference(x: torch.Tensor) -> torch.Tensor:
    """x · H_n along the last dimension (n = x.shape[-1]), in x's dtype, by the butterfly:
    stage h pairs element i with i + h inside each block of 2h and writes (a + b, a - b)."""
    n = x.shape[-1]
    check_power_of_two(n)
    y = x.reshape(-1, n)
    h = 1
    while h < n:
        pairs = y.reshape(-1, n // (2 * h), 2, h)
        y = torch.stack((pairs[:, :, 0] + pairs[:, :, 1], pairs[:, :, 0] - pairs[:, :, 1]), dim=2)
        h *= 2
    return (y.reshape(x.shape) / math.sqrt(n)).to(x.dtype)


@triton.jit
def _signs(i, j):
    """(-1)^popcount(i & j) as fp32, the parity folded by shifts and xors."""
    p = i & j
    p = p ^ (p >> 16)
    p = p ^ (p >> 8)
    p = p ^ (p >> 4)
    p = p ^ (p >> 2)
    p = p ^ (p >> 1)
    return 1.0 - 2.0 * (p & 1).to(tl.float32)


@triton.jit
def _sylvester(N: tl.constexpr):
    """H_N unnormalised (±1, fp32)."""
    return _signs(tl.arange(0, N)[:, None], tl.arange(0, N)[None, :])


@triton.jit
def hadamard_rows(x, ROWS: tl.constexpr, N: tl.constexpr):
    """x [ROWS, N] (fp32) times H_N / sqrt(N). N a power of two, 16 <= N; ROWS >= 16 when
    N <= 128 (a dot's M); ROWS * 16 >= 16 otherwise. Exact fp32 dots (ieee), no TF32."""
    if N <= 128:
        y = tl.dot(x, _sylvester(N), input_precision="ieee")
    else:
        M: tl.constexpr = N // 16
        # x[r, 16a + b]: the low factor mixes b, the high one a
        low = tl.dot(tl.reshape(x, (ROWS * 16, M)), _sylvester(M), input_precision="ieee")
        high_last = tl.permute(tl.reshape(low, (ROWS, 16, M)), (0, 2, 1))
        mixed = tl.dot(
            tl.reshape(high_last, (ROWS * M, 16)), _sylvester(16), input_precision="ieee"
        )
        y = tl.reshape(tl.permute(tl.reshape(mixed, (ROWS, M, 16)), (0, 2, 1)), (ROWS, N))
    return y * (1.0 / tl.sqrt(N * 1.0))


@triton.jit
def hadamard_chunk_into(acc, chunk, first_column, N: tl.constexpr, first_out=0):
    """acc [ROWS, OUT // 16, 16] plus what x's columns first_column .. first_column + 15 (chunk
    [ROWS, 16], fp32) add to columns first_out .. first_out + OUT - 1 of x · H_N, unnormalised
    (first_column and first_out multiples of 16; OUT = N for the whole product). ROWS >= 16.
    After the last chunk, `hadamard_chunks_done` gives them times 1 / sqrt(N) as [ROWS, OUT]."""
    z = tl.dot(chunk, _sylvester(16), input_precision="ieee")
    signs = _signs(first_column // 16, first_out // 16 + tl.arange(0, acc.shape[1]))
    return acc + signs[None, :, None] * z[:, None, :]


@triton.jit
def hadamard_chunks_done(acc, N: tl.constexpr):
    out = tl.reshape(acc, (acc.shape[0], acc.shape[1] * acc.shape[2]))
    return out * (1.0 / tl.sqrt(N * 1.0))


@triton.jit
def _rotate_rows_kernel(x_ptr, out_ptr, rows, stride_x, stride_out,
                        BLOCK_ROWS: tl.constexpr, N: tl.constexpr):  # fmt: skip
    first = tl.program_id(0).to(tl.int64) * BLOCK_ROWS
    r = first + tl.arange(0, BLOCK_ROWS)
    c = tl.arange(0, N)
    mask = (r < rows)[:, None]
    x = tl.load(x_ptr + r[:, None] * stride_x + c[None, :], mask=mask, other=0.0)
    y = hadamard_rows(x.to(tl.float32), BLOCK_ROWS, N)
    tl.store(
        out_ptr + r[:, None] * stride_out + c[None, :], y.to(out_ptr.dtype.element_ty), mask=mask
    )


ROTATE_BLOCK_ROWS = 16


def rotate_rows(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, n] · H_n / sqrt(n) on the GPU (or under Triton's interpreter), accumulated in
    fp32 and written in out's dtype (x's by default). n a power of two >= 16; contiguous
    columns. Rotating twice gives x back (H is its own inverse)."""
    if x.dim() != 2 or x.stride(1) != 1:
        got = f"{list(x.shape)} stride {x.stride()}"
        raise ValueError(f"rotate_rows takes [rows, n] with contiguous columns; got {got}")
    check_power_of_two(x.shape[1], minimum=16)
    if out is None:
        out = torch.empty_like(x)
    if out.shape != x.shape or out.stride(1) != 1:
        raise ValueError(
            f"out must be {list(x.shape)} with contiguous columns; got {list(out.shape)}"
        )
    grid = (triton.cdiv(x.shape[0], ROTATE_BLOCK_ROWS),)
    _rotate_rows_kernel[grid](
        x, out, x.shape[0], x.stride(0), out.stride(0), BLOCK_ROWS=ROTATE_BLOCK_ROWS, N=x.shape[1]
    )
    return out

"""MTP's greedy draft tokens from the int8 draft head, in one launch: GEMV, argmax and id map.

With the draft vocabulary (engine/draft_vocab.py) each of MTP's draft passes scores 40,960
rows of the lm_head for the 27B, in bf16 through cuBLAS, then vLLM takes the argmax and maps
the winner to its vocabulary id in three more small launches (LocalArgmaxMixin.get_top_tokens).
The rows are prepare's int8 group-128 values, dequantized at load; read as int8 they are half
the bytes. 0.30 ms of a 9.76 ms 27B MTP step went to those three draft-head GEMMs on the H200
(docs/results/2026-12-05-h200-27b-single-step-head.json, top kernels).

Here each program scores BLOCK_N rows for up to BLOCK_B hidden rows (fp32 accumulation of
the int8 codes times their group scales) and writes its best row per hidden row; the last
program of a column to finish (an atomic ticket) reduces the partial winners, writes each
hidden row's token id, and resets its ticket for the next launch. Ties go to the lowest row,
as torch.argmax's do; a row's logit is exact to fp32 accumulation, where vLLM's bf16 GEMM
rounds each logit to bf16 first, so a near-tie may pick the other row (a draft, verified like
any other: the output does not change).

Status: correct against float64 (tests/test_kernel_draft_argmax.py, CPU interpreter, the
27B's head among its shapes); compiles for sm80-sm120 here without spills; not run or timed on
a GPU yet.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

GROUP = 128  # prepare's group size: one scale per row and 128 inputs
BLOCK_B = 16  # hidden rows a program scores (tl.dot's smallest M)
BLOCK_N = 64  # draft-head rows a program scores
# partial winners the last program reads at a time: ptxas gives the kernel 96 registers a
# thread on sm90 with 128, 225 with 256 (fewer programs resident to stream the rows)
REDUCE_BLOCK = 128
# Triton 3.6's interpreter multiplies bf16 dot operands as raw bits (kernels/w4a16.py); under it
# the dot runs in fp32, exact for these operands as the GPU's bf16/fp16 products are
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit(do_not_specialize=["B"])  # one compile for every batch (no new one mid-serving)
def _draft_argmax_kernel(
    x_ptr, codes_ptr, scales_ptr, ids_ptr, part_val_ptr, part_row_ptr, tickets_ptr,
    out_ids_ptr, out_val_ptr, B, N, K, stride_xb, n_blocks,
    BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr,
    REDUCE_BLOCK: tl.constexpr, DOT_IN_FP32: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_b = tl.program_id(1)
    offs_b = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
    b_mask = offs_b < B
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = offs_n.to(tl.int64)
    offs_g = tl.arange(0, GROUP)
    groups = K // GROUP
    acc = tl.zeros((BLOCK_B, BLOCK_N), dtype=tl.float32)
    for g in range(groups):
        k = g * GROUP + offs_g
        x = tl.load(
            x_ptr + offs_b[:, None].to(tl.int64) * stride_xb + k[None, :],
            mask=b_mask[:, None],
            other=0.0,
        )
        codes = tl.load(codes_ptr + rows[:, None] * K + k[None, :], mask=n_mask[:, None], other=0)
        scale = tl.load(scales_ptr + rows * groups + g, mask=n_mask, other=0.0).to(tl.float32)
        if DOT_IN_FP32:
            part = tl.dot(x.to(tl.float32), tl.trans(codes.to(tl.float32)), input_precision="ieee")
        else:  # int8 codes are exact in bf16 and fp16, products accumulate in fp32
            part = tl.dot(x, tl.trans(codes.to(x.dtype)))
        acc += part * scale[None, :]
    acc = tl.where(n_mask[None, :], acc, float("-inf"))
    best = tl.max(acc, axis=1)
    best_row = pid_n * BLOCK_N + tl.argmax(acc, axis=1, tie_break_left=True)
    part = offs_b.to(tl.int64) * n_blocks + pid_n
    tl.store(part_val_ptr + part, best, mask=b_mask)
    tl.store(part_row_ptr + part, best_row, mask=b_mask)
    # every thread's partial store before the ticket; the ticket's release publishes them
    tl.debug_barrier()
    ticket = tl.atomic_add(tickets_ptr + pid_b, 1, sem="acq_rel", scope="gpu")
    if ticket == n_blocks - 1:  # the column's last program: all partials are written
        top = tl.full((BLOCK_B,), float("-inf"), dtype=tl.float32)
        top_row = tl.zeros((BLOCK_B,), dtype=tl.int32)
        for start in range(0, n_blocks, REDUCE_BLOCK):
            blocks = start + tl.arange(0, REDUCE_BLOCK)
            where = offs_b[:, None].to(tl.int64) * n_blocks + blocks[None, :]
            mask = b_mask[:, None] & (blocks < n_blocks)[None, :]
            # .cg: other SMs wrote these, read past this SM's L1 (as kernels/w4a16.py's split-K)
            vals = tl.load(
                part_val_ptr + where, mask=mask, other=float("-inf"), cache_modifier=".cg"
            )
            chunk_rows = tl.load(part_row_ptr + where, mask=mask, other=0, cache_modifier=".cg")
            chunk_top = tl.max(vals, axis=1)
            pick = tl.argmax(vals, axis=1, tie_break_left=True)
            chunk_row = tl.sum(tl.where(blocks[None, :] == start + pick[:, None], chunk_rows, 0), 1)
            better = chunk_top > top  # strictly: an equal value later is a higher row
            top_row = tl.where(better, chunk_row, top_row)
            top = tl.where(better, chunk_top, top)
        token = tl.load(ids_ptr + top_row, mask=b_mask, other=0)
        tl.store(out_ids_ptr + offs_b, token, mask=b_mask)
        tl.store(out_val_ptr + offs_b, top, mask=b_mask)
        # the next launch's count starts at zero (CUDA-graph replays reuse the tickets too)
        tl.atomic_xchg(tickets_ptr + pid_b, 0, sem="relaxed", scope="gpu")


class Int8DraftHead:
    """The draft head's int8 rows, their group scales and their vocabulary ids on one device,
    with the scratch its launches share (partial winners, one ticket per column of BLOCK_B
    hidden rows), sized for batches of up to `max_batch` rows before any graph is captured.
    Launches on one stream at a time, as vLLM's proposer makes them."""

    def __init__(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        token_ids: torch.Tensor,
        max_batch: int = BLOCK_B,
    ):
        rows, hidden = codes.shape
        problems = []
        if codes.dtype != torch.int8 or not codes.is_contiguous():
            problems.append(f"codes must be contiguous int8, got {codes.dtype}")
        if hidden % GROUP:
            problems.append(f"hidden size {hidden} is not a multiple of the group size {GROUP}")
        if tuple(scales.shape) != (rows, hidden // GROUP) or not scales.is_contiguous():
            problems.append(
                f"scales must be contiguous [{rows}, {hidden // GROUP}], got {list(scales.shape)}"
            )
        if tuple(token_ids.shape) != (rows,) or token_ids.dtype != torch.int64:
            problems.append(f"token_ids must be int64 [{rows}], got {token_ids.dtype}")
        if problems:
            raise ValueError("Int8DraftHead: " + "; ".join(problems))
        self.codes, self.scales, self.token_ids = codes, scales, token_ids
        self.n_blocks = triton.cdiv(rows, BLOCK_N)
        self._tickets = torch.zeros(0, dtype=torch.int32, device=codes.device)
        self._scratch(triton.cdiv(max_batch, BLOCK_B))

    def _scratch(self, columns: int) -> None:
        """Partials and tickets for `columns` columns of hidden rows (grown, never shrunk;
        a new ticket starts at zero, as each launch leaves its own). Never grown while a CUDA
        graph is captured: a graph captured before would keep the freed buffers."""
        if self._tickets.numel() >= columns:
            return
        device = self.codes.device
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"Int8DraftHead: a batch of over {self._tickets.numel() * BLOCK_B} hidden rows "
                "while a CUDA graph is captured; build it with max_batch covering the largest"
            )
        partials = columns * BLOCK_B * self.n_blocks
        self._part_val = torch.empty(partials, dtype=torch.float32, device=device)
        self._part_row = torch.empty(partials, dtype=torch.int32, device=device)
        self._tickets = torch.zeros(columns, dtype=torch.int32, device=device)

    def top_tokens(
        self, hidden: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [B, K] (bf16 or fp16, contiguous columns) -> (token id [B] int64, its logit
        [B] fp32) of each row's highest-scoring draft-head row; into `out` where given."""
        if (
            hidden.dim() != 2
            or hidden.shape[1] != self.codes.shape[1]
            or hidden.stride(1) != 1
            or hidden.dtype not in (torch.bfloat16, torch.float16)
            or hidden.device != self.codes.device
            or not (hidden.is_cuda or _INTERPRETED)
        ):
            raise ValueError(
                f"top_tokens takes [B, {self.codes.shape[1]}] bf16/fp16 rows with contiguous "
                f"columns on {self.codes.device}; got {hidden.dtype} {list(hidden.shape)} "
                f"stride {hidden.stride()} on {hidden.device}"
            )
        batch = hidden.shape[0]
        if out is None:
            out = (
                torch.empty(batch, dtype=torch.int64, device=hidden.device),
                torch.empty(batch, dtype=torch.float32, device=hidden.device),
            )
        ids, logits = out
        for part, dtype in ((ids, torch.int64), (logits, torch.float32)):
            if (
                part.shape != (batch,)
                or part.dtype != dtype
                or part.device != hidden.device
                or not part.is_contiguous()
            ):
                raise ValueError(
                    f"out must be contiguous ({batch},) int64 ids and ({batch},) fp32 logits"
                )
        if batch == 0:
            return ids, logits
        columns = triton.cdiv(batch, BLOCK_B)
        self._scratch(columns)
        rows, hidden_size = self.codes.shape
        _draft_argmax_kernel[(self.n_blocks, columns)](
            hidden, self.codes, self.scales, self.token_ids, self._part_val, self._part_row,
            self._tickets, ids, logits, batch, rows, hidden_size, hidden.stride(0),
            self.n_blocks, BLOCK_B=BLOCK_B, BLOCK_N=BLOCK_N, GROUP=GROUP,
            REDUCE_BLOCK=REDUCE_BLOCK, DOT_IN_FP32=_INTERPRETED, num_warps=4, num_stages=4,
        )  # fmt: skip
        return ids, logits

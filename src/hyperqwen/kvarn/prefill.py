"""The chunked-prefill attention over a paged KVarN cache (Triton), and its launcher.

A prefill step gives request r a chunk of q_len new tokens, the last q_len of its seq_len; query
j of the chunk attends causally to its own context L_j = seq_len - q_len + j + 1 and reads it by
attention.py's `read_plan`, as decode.py's kernel reads a verify block: the sink (block 0) in
16 bits from its side slot (quantized when evicted), blocks 1 .. F_j - 1 (F_j = L_j // 128)
quantized from the pool, its filling block F_j in 16 bits from its slot. The chunk's own tokens
are where the backend put them before attention runs (backend.py's forward): every token in its
tile's side slot, and every tile the step filled quantized into the pool, so a query reads the
chunk's earlier full tiles quantized and its own tile in 16 bits, as a decode step at its length
would. The storage and its int64 addressing are decode.py's (its module docstring).

`_prefill_kernel`, grid (work items, KV heads): an item is up to QUERIES = BLOCK_M // G
consecutive queries of one request, all G query heads of the KV head as rows (query j's head g
is row (j - first) * G + g), so each tile is dequantized once for all of them. The program runs
decode.py's loops over the tiles with one online softmax (flash-attention style, fp32, one
[rows, BLOCK_N] score block at a time, never the chunk x context matrix):
1. the quantized blocks 1 (0: an evicted sink) .. F_last - 1 of its last query, rows masked past
   their own F_j, with the query rotated (hadamard.py) and the accumulator in the rotated basis;
2. the accumulator rotated back (H is its own inverse; the softmax's rescaling is per row, so it
   commutes with the rotation), then the 16-bit sink and filling blocks F_first .. F_last with
   the plain query, each row up to its own L_j;
3. the sum divided by the softmax's denominator, written in the query's dtype.
Every query reads its own token, so no row's sum is empty. Items are launched longest context
first (the host orders them: prefill runs eagerly, its query_start_loc and seq_lens are on the
host), so a long request's items do not start last.

Unlike decode there is no split over the context: each item reads its whole context once. A
long chunk has enough items to fill a GPU; a short one after a long context has few, each
walking every tile alone (a split with decode's log-sum-exp merge would spread it; not built).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from hyperqwen.kvarn.decode import (
    BLOCK_N,
    attend_quantized_tiles,
    attend_side_tiles,
    check_cache_args,
    dot_operands,
    output_for,
)
from hyperqwen.kvarn.hadamard import hadamard_rows
from hyperqwen.kvarn.layout import TileLayout

# query rows (queries x grouped heads) per program: 5 queries of the 27B's 6 heads per KV head.
# Untuned (checked on the H200, not timed). Compiled for sm86 at the 27B's shapes (fit.py), 64 rows
# take all but 2 KB of its 99 KB of shared memory and spill several times the registers of
# 32; 4 warps spill more than 8. bench.py's --prefill sweeps rows.
PREFILL_ROWS = 32
PREFILL_WARPS = 8


@triton.jit
def _prefill_kernel(q_ptr, pool_ptr, block_table_ptr, side_k_ptr, side_v_ptr, slot_ptr,
                    seq_lens_ptr, query_start_ptr, work_ptr, out_ptr, sm_scale,
                    stride_qt, stride_qh, stride_block, stride_head, stride_table,
                    stride_skb, stride_skt, stride_skh, stride_svb, stride_svt, stride_svh,
                    stride_ot, stride_oh,
                    G: tl.constexpr, QUERIES: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, T: tl.constexpr, D: tl.constexpr,
                    AT: tl.constexpr, V_LEVELS: tl.constexpr, DOT: tl.constexpr):  # fmt: skip
    item = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    req = tl.load(work_ptr + 2 * item)
    first_query = tl.load(work_ptr + 2 * item + 1)
    q_start = tl.load(query_start_ptr + req)
    q_len = tl.load(query_start_ptr + req + 1) - q_start
    past = tl.load(seq_lens_ptr + req) - q_len  # the request's tokens before the chunk

    m = tl.arange(0, BLOCK_M)
    j = first_query + m // G
    row_ok = (m < QUERIES * G) & (j < q_len)
    context = tl.where(row_ok, past + j + 1, 0)  # L_j; 0 reads nothing
    token = (q_start + j).to(tl.int64)
    head = (kv_head * G + m % G).to(tl.int64)
    d = tl.arange(0, D)
    q_rows = q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    first_context = past + first_query + 1
    last_context = past + tl.minimum(first_query + QUERIES, q_len)
    table = block_table_ptr + req.to(tl.int64) * stride_table
    sink_in_side = tl.load(slot_ptr + tl.load(table).to(tl.int64)) >= 0

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    q = tl.load(q_rows, mask=row_ok[:, None], other=0.0)
    qr = hadamard_rows(q.to(tl.float32), BLOCK_M, D)
    m_i, l_i, acc = attend_quantized_tiles(
        pool_ptr, table, stride_block, stride_head, kv_head, tl.where(sink_in_side, 1, 0),
        last_context // T, qr, context // T, sm_scale, m_i, l_i, acc, BLOCK_N, T, D, AT,
        V_LEVELS, DOT,
    )  # fmt: skip
    acc = hadamard_rows(acc, BLOCK_M, D)
    # loaded again rather than kept live through the quantized loop (registers)
    q = tl.load(q_rows, mask=row_ok[:, None], other=0.0)
    m_i, l_i, acc = attend_side_tiles(
        side_k_ptr, side_v_ptr, slot_ptr, table, stride_skb, stride_skt, stride_skh,
        stride_svb, stride_svt, stride_svh, kv_head, first_context, last_context,
        past + q_len, q, context, sm_scale, m_i, l_i, acc, BLOCK_N, T, D, DOT,
    )  # fmt: skip
    out = acc / tl.where(row_ok, l_i, 1.0)[:, None]
    dst = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def work_items(
    query_start_loc: list[int], seq_lens: list[int], queries_per_item: int
) -> list[tuple[int, int]]:
    """(request, first query of the chunk) of each program, `queries_per_item` queries each,
    longest last context first."""
    items = []
    for req, seq_len in enumerate(seq_lens):
        q_len = query_start_loc[req + 1] - query_start_loc[req]
        for first in range(0, q_len, queries_per_item):
            last_context = seq_len - q_len + min(first + queries_per_item, q_len)
            items.append((-last_context, req, first))
    return [(req, first) for _, req, first in sorted(items)]


def prefill_attention(
    query: torch.Tensor,
    pool: torch.Tensor,
    block_table: torch.Tensor,
    side_k: torch.Tensor,
    side_v: torch.Tensor,
    slot_of_block: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    layout: TileLayout | None = None,
    host_query_start_loc: torch.Tensor | None = None,
    host_seq_lens: torch.Tensor | None = None,
    rows: int = PREFILL_ROWS,
) -> torch.Tensor:
    """Causal attention of each request's chunk over the KVarN cache (module docstring):
    request r's queries are rows query_start_loc[r] .. query_start_loc[r + 1] - 1 of query
    [num_tokens, Hq, D] (bf16 or fp16), the last of its seq_lens[r] tokens, any number of
    them; their outputs go to the same rows of out (query's dtype; other rows untouched).
    host_query_start_loc / host_seq_lens: host copies of those two, if the caller has them
    (else they are copied, a sync). rows: query rows per program (a power of two >= 16)."""
    layout = check_cache_args(
        query, pool, block_table, side_k, side_v, slot_of_block, seq_lens, query_start_loc,
        layout,
    )  # fmt: skip
    out = output_for(query, out)
    heads, kv_heads, d = query.shape[1], pool.shape[1], layout.head_dim
    group = heads // kv_heads
    if rows < 16 or rows & (rows - 1):
        raise ValueError(f"rows={rows}: a power of two >= 16 (a dot's M)")
    block_m = max(rows, triton.next_power_of_2(group))
    queries = block_m // group
    starts = (query_start_loc if host_query_start_loc is None else host_query_start_loc).tolist()
    lengths = (seq_lens if host_seq_lens is None else host_seq_lens).tolist()
    for req, seq_len in enumerate(lengths):
        if not 0 <= starts[req + 1] - starts[req] <= seq_len:
            raise ValueError(
                f"request {req}: {starts[req + 1] - starts[req]} queries of {seq_len} tokens"
            )
    items = work_items(starts, lengths, queries)
    if not items:
        return out
    work = torch.tensor(items, dtype=torch.int32).to(query.device)
    scale = scale if scale is not None else 1 / math.sqrt(d)
    _prefill_kernel[(len(items), kv_heads)](
        query, pool, block_table, side_k, side_v, slot_of_block, seq_lens, query_start_loc,
        work, out, scale,
        query.stride(0), query.stride(1), pool.stride(0), pool.stride(1),
        block_table.stride(0), *side_k.stride()[:3], *side_v.stride()[:3],
        out.stride(0), out.stride(1),
        G=group, QUERIES=queries, BLOCK_M=block_m, BLOCK_N=BLOCK_N, T=layout.tokens, D=d,
        AT=layout.offsets, V_LEVELS=layout.v_levels, DOT=dot_operands(query.dtype),
        num_warps=PREFILL_WARPS, num_stages=1,
    )  # fmt: skip
    return out

"""The fused split-K decode attention over a paged KVarN cache (Triton), and its launcher.

Each request has 1 + k query tokens (k = 0 for a plain decode step, k drafts for an MTP verify
step), the last ones of its seq_len tokens; query j of n attends causally to its own context
L_j = seq_len - n + j + 1 and reads it by attention.py's `read_plan`: tokens 0-127 (the sink)
and those of its filling block F_j = L_j // 128 in 16 bits, blocks 1 .. F_j - 1 quantized; a
full sink without a 16-bit tile in the side cache (evicted: slots.py) is read quantized too.
So a verify step reads what n decode steps at those lengths would, also where its drafts fill
a block: earlier queries read that block's 16-bit copy, later ones its quantized tile.

Storage, all addressed in int64:
  pool            uint8 [num_blocks, Hkv, tile_bytes], the quantized tiles (layout.py)
  block_table     int32 [num_reqs, max_blocks]: pool block of block position b
  side_k, side_v  bf16/fp16 [num_slots, 128, Hkv, D], 16-bit tiles in the model's basis
  slot_of_block   int32 [num_blocks]: the side slot holding pool block k's 16-bit tile, -1 for
                  none (slots.py); read for the blocks of position 0 and of each query's F_j.
                  The filling blocks must have one; the sink is read quantized without one
                  (then it must be full and stored)
A token past seq_len in a 16-bit tile is never loaded, nor is any block outside the plan, so
neither needs zeroing (a zeroing pass is what corrupts blocks shared under prefix caching).

Step 1, `_partition_kernel`, grid (requests, KV heads, splits + 1). Program (r, h, s < splits)
takes the s-th share of the quantized blocks 1 (0 for an evicted sink) .. F_max - 1 for all
n·G query rows of KV head h (G query heads per KV head) and dequantizes in registers, folding
the scales into the small operands: with the query rotated,
qr·k = r_t (Σ_c (qr_c s_c) q_tc + Σ_c qr_c z_c), so one dot of qr·s (16-bit) with the raw
codes (0..15, exact in 16 bits) per half tile; for values Σ_t p_t (v_tc σ_t + ζ_t) =
dot(p·σ, codes) + Σ_t p_t ζ_t. A row whose query does not read a block (b >= F_j) is masked.
Program (r, h, splits) reads the 16-bit tiles (the sink if it has a slot, and the blocks
holding the queries' filling tokens) with the plain query. Each writes its unnormalised
output, row maximum and sum, fp32. Step 2, `_merge_kernel`, grid (query tokens, KV heads),
merges them by log-sum-exp, rotates the quantized partitions' sum back
(hadamard.py) and adds the 16-bit one, which is in the model's basis already.

The two reads are jit helpers, `attend_quantized_tiles` and `attend_side_tiles`, which
prefill.py's kernel runs too (both phases in one program), as it shares the launcher's
argument checks (`check_cache_args`, `output_for`).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from hyperqwen.kvarn.dequant import k_codes, v_codes
from hyperqwen.kvarn.hadamard import hadamard_rows
from hyperqwen.kvarn.layout import TileLayout
from hyperqwen.kvarn.store import fp16_section

# The partition kernel's tile loop pipelined in 2 stages (the next half tile copied while this
# one's dots run) takes about 150 KB of shared memory at the 27B's shapes (kvarn/fit.py), which
# sm80 and sm90 have and sm86/89 (99 KB) do not; on the H100 it was the faster of 1 and 2
# (docs/results/2026-12-06-h100-kvarn-decode-tuning.json). Fitted at rows <= 32, head_dim <= 256.
PIPELINED_SHARED_BYTES = 160 * 1024
PIPELINED_MAX_ROWS, PIPELINED_MAX_HEAD_DIM = 32, 256


def pipeline_stages(shared_bytes: int, rows: int, head_dim: int) -> int:
    """The partition kernel's num_stages for a GPU with `shared_bytes` of shared memory per
    block (opt-in) at `rows` query rows per program (BLOCK_M) and this head_dim."""
    fits = rows <= PIPELINED_MAX_ROWS and head_dim <= PIPELINED_MAX_HEAD_DIM
    return 2 if fits and shared_bytes >= PIPELINED_SHARED_BYTES else 1


BLOCK_N = 64  # tokens per dot: half a tile, so K or V codes as bf16 take 32 KB of shared memory
# 8 warps: with 4, the partition kernel's [rows, 256] fp32 accumulator, query and operands
# spill two to four times as many registers (SASS compiled for sm86, kvarn/fit.py's shapes)
PARTITION_WARPS, MERGE_WARPS = 8, 4


@triton.jit
def _online_softmax(scores, m_i, l_i, acc):
    """One step of the running softmax: (p, m, l, acc rescaled); rows with every score -inf so
    far keep m = -inf and p = 0 (no NaN from -inf - -inf)."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(scores - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    return p, m_new, l_i * alpha + tl.sum(p, axis=1), acc * alpha[:, None]


@triton.jit
def attend_quantized_part(tile, start, qr, reads, sm_scale, m_i, l_i, acc,
                          BLOCK_N: tl.constexpr, D: tl.constexpr, AT: tl.constexpr,
                          V_LEVELS: tl.constexpr, DOT: tl.constexpr):  # fmt: skip
    """Tokens start .. start + BLOCK_N - 1 of one quantized tile (its first byte `tile`) into
    the running softmax of the rotated query rows qr [rows, D] (fp32) whose `reads` [rows] is
    set; acc accumulates in the rotated basis. The scales are folded into the small operands
    (module docstring). Returns (m, l, acc)."""
    d = tl.arange(0, D)
    k_scale = tl.load(fp16_section(tile, AT.k_scale) + d).to(tl.float32)
    k_zero = tl.load(fp16_section(tile, AT.k_zero) + d).to(tl.float32)
    q_scaled = (qr * k_scale[None, :]).to(DOT)
    bias = tl.sum(qr * k_zero[None, :], axis=1)
    rows = start + tl.arange(0, BLOCK_N)
    codes = k_codes(tile, rows[:, None], 0, BLOCK_N, D, AT, D).to(DOT)
    r = tl.load(fp16_section(tile, AT.k_token_scale) + rows).to(tl.float32)
    dots = tl.dot(q_scaled, tl.trans(codes))
    scores = (dots + bias[:, None]) * (r * sm_scale)[None, :]
    scores = tl.where(reads[:, None], scores, float("-inf"))
    p, m_i, l_i, acc = _online_softmax(scores, m_i, l_i, acc)
    v_scale = tl.load(fp16_section(tile, AT.v_scale) + rows).to(tl.float32)
    v_zero = tl.load(fp16_section(tile, AT.v_zero) + rows).to(tl.float32)
    codes = v_codes(tile, rows[:, None], 0, BLOCK_N, D, AT, D, V_LEVELS).to(DOT)
    acc += tl.dot((p * v_scale[None, :]).to(DOT), codes)
    acc += tl.sum(p * v_zero[None, :], axis=1)[:, None]
    return m_i, l_i, acc


@triton.jit
def attend_side_tile(side_k, side_v, stride_kt, stride_vt, b, in_side, reads, q, context,
                     seq_len, sm_scale, m_i, l_i, acc, BLOCK_N: tl.constexpr, T: tl.constexpr,
                     D: tl.constexpr, DOT: tl.constexpr):  # fmt: skip
    """Block position b's 16-bit tile (side_k / side_v: its slot's token 0 of this KV head)
    into the running softmax of the plain query rows q [rows, D] whose `reads` [rows] is set,
    each up to its own context [rows]; acc in the model's basis. Nothing is loaded where
    in_side is false (no slot) or past seq_len. Returns (m, l, acc)."""
    d = tl.arange(0, D)
    for start in tl.static_range(0, T, BLOCK_N):
        rows = start + tl.arange(0, BLOCK_N)
        position = b * T + rows
        present = ((position < seq_len) & in_side)[:, None]
        k = tl.load(side_k + rows[:, None].to(tl.int64) * stride_kt + d[None, :],
                    mask=present, other=0.0)  # fmt: skip
        scores = tl.dot(q.to(DOT), tl.trans(k.to(DOT))) * sm_scale
        visible = reads[:, None] & (position[None, :] < context[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        p, m_i, l_i, acc = _online_softmax(scores, m_i, l_i, acc)
        v = tl.load(side_v + rows[:, None].to(tl.int64) * stride_vt + d[None, :],
                    mask=present, other=0.0)  # fmt: skip
        acc += tl.dot(p.to(DOT), v.to(DOT))
    return m_i, l_i, acc


@triton.jit
def attend_quantized_tiles(pool_ptr, table, stride_block, stride_head, kv_head, first, end, qr,
                           filling, sm_scale, m_i, l_i, acc, BLOCK_N: tl.constexpr,
                           T: tl.constexpr, D: tl.constexpr, AT: tl.constexpr,
                           V_LEVELS: tl.constexpr, DOT: tl.constexpr):  # fmt: skip
    """Block positions first .. end - 1 of a request's table, read quantized from the pool by
    the rows whose filling block [rows] is past them, BLOCK_N tokens per iteration of one
    loop (so a pipelined launch copies the next part while this one's dots run). Returns
    (m, l, acc)."""
    PARTS: tl.constexpr = T // BLOCK_N
    for part in range(first * PARTS, end * PARTS):
        b = part // PARTS
        block = tl.load(table + b).to(tl.int64)
        tile = pool_ptr + block * stride_block + kv_head.to(tl.int64) * stride_head
        m_i, l_i, acc = attend_quantized_part(tile, (part % PARTS) * BLOCK_N, qr, b < filling,
                                              sm_scale, m_i, l_i, acc, BLOCK_N, D, AT,
                                              V_LEVELS, DOT)  # fmt: skip
    return m_i, l_i, acc


@triton.jit
def attend_side_tiles(side_k_ptr, side_v_ptr, slot_ptr, table,
                      stride_skb, stride_skt, stride_skh, stride_svb, stride_svt, stride_svh,
                      kv_head, first_context, last_context, seq_len, q, context, sm_scale,
                      m_i, l_i, acc, BLOCK_N: tl.constexpr, T: tl.constexpr, D: tl.constexpr,
                      DOT: tl.constexpr):  # fmt: skip
    """The 16-bit reads of rows whose contexts [rows] lie in first_context .. last_context:
    the sink, then the filling blocks of the first context to the block of the last one's
    last token (a later one would hold no token, and the tables need not name it); a block
    without a slot (only an evicted sink) loads nothing and is read quantized instead.
    Returns (m, l, acc), acc in the model's basis."""
    filling = context // T
    first_filling = tl.maximum(first_context // T, 1)
    for i in range(0, 1 + tl.maximum((last_context - 1) // T - first_filling + 1, 0)):
        b = tl.where(i == 0, 0, first_filling + i - 1)
        slot = tl.load(slot_ptr + tl.load(table + b).to(tl.int64)).to(tl.int64)
        in_side = slot >= 0
        slot = tl.maximum(slot, 0)
        side_k = side_k_ptr + slot * stride_skb + kv_head.to(tl.int64) * stride_skh
        side_v = side_v_ptr + slot * stride_svb + kv_head.to(tl.int64) * stride_svh
        reads = in_side & ((b == 0) | (b == filling))
        m_i, l_i, acc = attend_side_tile(side_k, side_v, stride_skt, stride_svt, b, in_side,
                                         reads, q, context, seq_len, sm_scale, m_i, l_i, acc,
                                         BLOCK_N, T, D, DOT)  # fmt: skip
    return m_i, l_i, acc


@triton.jit
def _partition_kernel(q_ptr, pool_ptr, block_table_ptr, side_k_ptr, side_v_ptr, slot_ptr,
                      seq_lens_ptr, query_start_ptr, part_o_ptr, part_ml_ptr,
                      sm_scale, num_splits,
                      stride_qt, stride_qh, stride_block, stride_head,
                      stride_table,
                      stride_skb, stride_skt, stride_skh, stride_svb, stride_svt, stride_svh,
                      stride_pot, stride_poh, stride_pos, stride_pmt, stride_pmh, stride_pms,
                      G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      T: tl.constexpr, D: tl.constexpr, AT: tl.constexpr,
                      V_LEVELS: tl.constexpr, DOT: tl.constexpr):  # fmt: skip
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(query_start_ptr + req)
    q_len = tl.load(query_start_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)

    m = tl.arange(0, BLOCK_M)
    j = m // G
    row_ok = j < q_len
    context = tl.where(row_ok, seq_len - q_len + j + 1, 0)  # L_j; 0 reads nothing
    filling = context // T  # F_j
    token = (q_start + j).to(tl.int64)
    head = (kv_head * G + m % G).to(tl.int64)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)  # fmt: skip
    last_filling = seq_len // T  # F of the last query, the largest
    table = block_table_ptr + req.to(tl.int64) * stride_table
    sink_in_side = tl.load(slot_ptr + tl.load(table).to(tl.int64)) >= 0

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    if split < num_splits:
        qr = hadamard_rows(q.to(tl.float32), BLOCK_M, D)
        first_quantized = tl.where(sink_in_side, 1, 0)
        quantized = tl.maximum(last_filling - first_quantized, 0)
        share = tl.cdiv(quantized, num_splits)
        first = first_quantized + split * share
        m_i, l_i, acc = attend_quantized_tiles(
            pool_ptr, table, stride_block, stride_head, kv_head, first,
            tl.minimum(first + share, last_filling), qr, filling, sm_scale, m_i, l_i, acc,
            BLOCK_N, T, D, AT, V_LEVELS, DOT,
        )  # fmt: skip
    else:
        m_i, l_i, acc = attend_side_tiles(
            side_k_ptr, side_v_ptr, slot_ptr, table, stride_skb, stride_skt, stride_skh,
            stride_svb, stride_svt, stride_svh, kv_head, seq_len - q_len + 1, seq_len, seq_len,
            q, context, sm_scale, m_i, l_i, acc, BLOCK_N, T, D, DOT,
        )  # fmt: skip

    part = token * stride_pot + head * stride_poh + split.to(tl.int64) * stride_pos
    tl.store(part_o_ptr + part[:, None] + d[None, :], acc, mask=row_ok[:, None])
    ml = part_ml_ptr + token * stride_pmt + head * stride_pmh + split.to(tl.int64) * stride_pms
    tl.store(ml, m_i, mask=row_ok)
    tl.store(ml + 1, l_i, mask=row_ok)


@triton.jit
def _merge_kernel(part_o_ptr, part_ml_ptr, out_ptr, num_splits,
                  stride_pot, stride_poh, stride_pos, stride_pmt, stride_pmh, stride_pms,
                  stride_ot, stride_oh,
                  G: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    ok = h < G
    head = (tl.program_id(1) * G + h).to(tl.int64)
    d = tl.arange(0, D)
    o = part_o_ptr + token * stride_pot + head[:, None] * stride_poh + d[None, :]
    ml = part_ml_ptr + token * stride_pmt + head * stride_pmh
    # the 16-bit partition first; any partition may be empty (m = -inf: an empty quantized
    # share, or no 16-bit token when an evicted sink is read quantized at a tile boundary),
    # so exponents are taken against a finite maximum and an empty one weighs exp(-inf) = 0
    top = tl.load(ml + num_splits * stride_pms, mask=ok, other=0.0)
    total = tl.load(ml + num_splits * stride_pms + 1, mask=ok, other=1.0)
    plain = tl.load(o + num_splits * stride_pos, mask=ok[:, None], other=0.0)
    rotated = tl.zeros((BLOCK_H, D), tl.float32)
    for s in range(0, num_splits):
        m_s = tl.load(ml + s * stride_pms, mask=ok, other=float("-inf"))
        new_top = tl.maximum(top, m_s)
        finite_top = tl.where(new_top == float("-inf"), 0.0, new_top)
        old, weight = tl.exp(top - finite_top), tl.exp(m_s - finite_top)
        total = total * old + weight * tl.load(ml + s * stride_pms + 1, mask=ok, other=0.0)
        part = tl.load(o + s * stride_pos, mask=ok[:, None], other=0.0)
        rotated = rotated * old[:, None] + weight[:, None] * part
        plain = plain * old[:, None]
        top = new_top
    out = (hadamard_rows(rotated, BLOCK_H, D) + plain) / total[:, None]
    dst = out_ptr + token * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=ok[:, None])


def partition_rows(max_query_len: int, group: int) -> int:
    """The partition kernel's BLOCK_M: a request's query rows per KV head, padded for the dots."""
    return max(16, triton.next_power_of_2(max_query_len * group))


def served_stages(device: torch.device, rows: int, head_dim: int) -> int:
    """pipeline_stages for this device (1 off CUDA: the interpreter does not pipeline)."""
    if device.type != "cuda":
        return 1
    shared = torch.cuda.get_device_properties(device).shared_memory_per_block_optin
    return pipeline_stages(shared, rows, head_dim)


def dot_operands(dtype: torch.dtype):
    """The dots' operand type: the cache's 16-bit type, fp32 under Triton's interpreter, whose
    dot multiplies a bf16 tensor's raw bits (triton 3.6 interpreter.py create_dot): the CPU
    tests then check the arithmetic without the operands' rounding, the GPU test with it."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return tl.float32
    return tl.bfloat16 if dtype == torch.bfloat16 else tl.float16


def _check(name: str, tensor: torch.Tensor, dtypes, dims: int) -> None:
    if tensor.dtype not in dtypes or tensor.dim() != dims:
        allowed = " or ".join(str(t).removeprefix("torch.") for t in dtypes)
        raise ValueError(
            f"{name} must be a {dims}-D {allowed} tensor; got {tensor.dtype} {list(tensor.shape)}"
        )


def check_cache_args(
    query: torch.Tensor,
    pool: torch.Tensor,
    block_table: torch.Tensor,
    side_k: torch.Tensor,
    side_v: torch.Tensor,
    slot_of_block: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    layout: TileLayout | None,
) -> TileLayout:
    """The checks every reader of a KVarN cache (decode, prefill) makes of its arguments (the
    module docstring's storage); returns the layout (query's head_dim by default)."""
    _check("query", query, (torch.bfloat16, torch.float16), 3)
    num_tokens, heads, d = query.shape
    layout = layout or TileLayout(head_dim=d)
    layout.check_pool(pool)
    kv_heads = pool.shape[1]
    if query.stride(2) != 1:
        raise ValueError(f"query must be contiguous along head_dim; stride {query.stride()}")
    if layout.head_dim != d or heads % kv_heads:
        raise ValueError(
            f"query [{num_tokens}, {heads}, {d}] does not fit a pool of {kv_heads} KV heads of "
            f"head_dim {layout.head_dim}: query heads must be a multiple of KV heads"
        )
    for name, side in (("side_k", side_k), ("side_v", side_v)):
        _check(name, side, (query.dtype,), 4)
        if side.shape[1:] != (layout.tokens, kv_heads, d) or side.stride(3) != 1:
            raise ValueError(
                f"{name} must be [num_slots, {layout.tokens}, {kv_heads}, {d}] contiguous "
                f"along head_dim; got {list(side.shape)} stride {side.stride()}"
            )
    num_reqs = seq_lens.shape[0]
    _check("block_table", block_table, (torch.int32,), 2)
    if block_table.shape[0] != num_reqs or block_table.stride(1) != 1:
        raise ValueError(f"block_table must be int32 [{num_reqs}, max_blocks], rows contiguous")
    _check("slot_of_block", slot_of_block, (torch.int32,), 1)
    if slot_of_block.stride(0) != 1:
        raise ValueError("slot_of_block must be contiguous")
    _check("seq_lens", seq_lens, (torch.int32,), 1)
    _check("query_start_loc", query_start_loc, (torch.int32,), 1)
    if query_start_loc.shape[0] != num_reqs + 1:
        raise ValueError(f"query_start_loc must be int32 [{num_reqs + 1}]")
    return layout


def output_for(query: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """out checked to take the attention of query (its dtype and shape, contiguous along D),
    or a new tensor for it."""
    if out is None:
        out = torch.empty_like(query)
    if out.shape != query.shape or out.dtype != query.dtype or out.stride(2) != 1:
        raise ValueError(f"out must be {query.dtype} {list(query.shape)}, contiguous along D")
    return out


def decode_attention(
    query: torch.Tensor,
    pool: torch.Tensor,
    block_table: torch.Tensor,
    side_k: torch.Tensor,
    side_v: torch.Tensor,
    slot_of_block: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    num_splits: int,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    layout: TileLayout | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Attention of query [num_tokens, Hq, D] (bf16 or fp16; request r's queries are rows
    query_start_loc[r] .. query_start_loc[r + 1] - 1, at most max_query_len of them, the last
    of its seq_lens[r] tokens) over the KVarN cache described in the module docstring, into
    out [num_tokens, Hq, D] (query's dtype). num_splits: how many programs share each
    request's quantized blocks per KV head (a fixed number keeps the launch graph-capturable;
    splits with no blocks write empty partials). num_stages: the partition kernel's pipeline
    (served_stages for the query's GPU unless given; the bench sweeps it). Indices are not
    checked on the GPU."""
    layout = check_cache_args(
        query, pool, block_table, side_k, side_v, slot_of_block, seq_lens, query_start_loc,
        layout,
    )  # fmt: skip
    num_tokens, heads, d = query.shape
    kv_heads, num_reqs = pool.shape[1], seq_lens.shape[0]
    if not 1 <= max_query_len <= layout.tokens:
        raise ValueError(f"1 <= max_query_len <= {layout.tokens}; got {max_query_len}")
    if num_splits < 1:
        raise ValueError(f"num_splits={num_splits}: at least one program per KV head")
    out = output_for(query, out)
    if num_tokens == 0:
        return out

    group = heads // kv_heads
    block_m = partition_rows(max_query_len, group)
    if num_stages is None:
        num_stages = served_stages(query.device, block_m, d)
    partials = num_splits + 1
    part_o = torch.empty(num_tokens, heads, partials, d, dtype=torch.float32, device=query.device)
    part_ml = torch.empty(num_tokens, heads, partials, 2, dtype=torch.float32, device=query.device)
    scale = scale if scale is not None else 1 / math.sqrt(d)
    _partition_kernel[(num_reqs, kv_heads, partials)](
        query, pool, block_table, side_k, side_v, slot_of_block, seq_lens, query_start_loc,
        part_o, part_ml, scale, num_splits,
        query.stride(0), query.stride(1), pool.stride(0), pool.stride(1),
        block_table.stride(0),
        *side_k.stride()[:3], *side_v.stride()[:3],
        *part_o.stride()[:3], *part_ml.stride()[:3],
        G=group, BLOCK_M=block_m,
        BLOCK_N=BLOCK_N, T=layout.tokens, D=d, AT=layout.offsets, V_LEVELS=layout.v_levels,
        DOT=dot_operands(query.dtype), num_warps=PARTITION_WARPS, num_stages=num_stages,
    )  # fmt: skip
    _merge_kernel[(num_tokens, kv_heads)](
        part_o, part_ml, out, num_splits,
        *part_o.stride()[:3], *part_ml.stride()[:3], out.stride(0), out.stride(1),
        G=group, BLOCK_H=max(16, triton.next_power_of_2(group)), D=d, num_warps=MERGE_WARPS,
    )  # fmt: skip
    return out

"""Chunked prefill over a KVarN cache by dequantizing the context once per chunk and running a
paged FlashAttention over it (vLLM's, FA3 on Hopper, FA2 on Ampere and Ada).

prefill.py's Triton kernel dequantizes every tile in registers once per program of a few
queries (5 of the 27B's), so a chunk of 8k queries dequantizes each context tile about 1,600
times per KV head and its dots have 32 rows; its cold TTFT at 112k was 5.3x stock's on the
H100 (docs/results/2026-12-05-h100-27b-depth-kvarn.json). Here each context tile is
dequantized once per chunk, into a bf16 scratch, and the attention is FlashAttention's.

The read rule is prefill.py's (attention.read_plan): query j of request r's chunk, at
context L_j with filling tile F_j = L_j // 128, reads tiles 0 .. F_j - 1 (the sink in 16
bits from its side slot, or quantized when evicted; tiles 1 .. quantized) and the tokens
128 F_j .. L_j - 1 of its filling tile in 16 bits from its slot. So a tile the chunk itself
fills is read quantized by the queries after it and in 16 bits by its own queries, and the
attention splits in two parts merged by their log-sum-exp:
- part A, the tiles below each query's filling tile: the chunk's queries in groups of one
  filling tile each (at most 65 groups per 8k chunk); group F reads tiles [0, F) of the
  scratch, all of them (no mask), as one sequence of a varlen batch whose block table row
  names the scratch pages. The context goes through the scratch in segments of its pages
  (SCRATCH_TILES), one FlashAttention call and one merge per segment;
- part B, the filling tile: group F reads its side slot's tokens 128 F .. up to its last
  query, causal (FlashAttention aligns the mask to the bottom right, so each query stops at
  itself), the side cache's tiles as the pages.
A query at a tile boundary (L_j = 128 F_j) has an empty part B, and one with F_j = 0 an
empty part A; FA2 gives an empty row's log-sum-exp as +inf, FA3 as -inf: both weigh 0.

The scratch is one per process, shared by the layers (they run one after another), and
allocated in vLLM's profile run like the side cache, so vLLM counts it (capacity.py counts
the same bytes). Prefill runs eagerly (the backend gives the host's lengths and slot map).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from hyperqwen.kvarn.dequant import dequantize_tiles
from hyperqwen.kvarn.layout import TileLayout
from hyperqwen.kvarn.sizing import SCRATCH_TILES


class Scratch:
    """The 16-bit pages a segment of a context is dequantized into, [SCRATCH_TILES, 128, Hkv, D]
    for K and for V, one per (shape, dtype, device) in the process."""

    _shared: ClassVar[dict[tuple, Scratch]] = {}

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device) -> None:
        self.key = torch.empty(shape, dtype=dtype, device=device)
        self.value = torch.empty(shape, dtype=dtype, device=device)

    @classmethod
    def get(cls, kv_heads: int, head_dim: int, tile: int, dtype, device) -> Scratch:
        shape = (SCRATCH_TILES, tile, kv_heads, head_dim)
        key = (shape, dtype, str(torch.device(device)))
        if key not in cls._shared:
            cls._shared[key] = cls(shape, dtype, device)
        return cls._shared[key]


@dataclass(frozen=True)
class Group:
    """Queries rows first .. first + count - 1 of the step's query tensor, all with filling
    tile F (their contexts 128 F .. 128 F + 127), of the request in block-table row `row`;
    `last_context`: the last one's."""

    row: int
    filling: int
    first: int
    count: int
    last_context: int


def filling_groups(starts: list[int], seq_lens: list[int], rows: range) -> list[Group]:
    """Each prefill request's chunk cut where the filling tile changes."""
    groups = []
    for row in rows:
        q_start, q_len = starts[row], starts[row + 1] - starts[row]
        past = seq_lens[row] - q_len
        j = 0
        while j < q_len:
            filling = (past + j + 1) // 128
            end = min(q_len, 128 * (filling + 1) - 1 - past)  # last context 128 F + 127
            groups.append(Group(row, filling, q_start + j, end - j, past + end))
            j = end
    return groups


Attend = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def attend_flash(q, k_pages, v_pages, cu_q, max_q, used_k, max_k, block_table, causal, scale):
    """vLLM's FlashAttention over pages: (out [n, Hq, D], log-sum-exp [Hq, n] fp32)."""
    from vllm.v1.attention.backends.fa_utils import get_flash_attn_version
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func(
        q, k_pages, v_pages, max_seqlen_q=max_q, cu_seqlens_q=cu_q, max_seqlen_k=max_k,
        seqused_k=used_k, softmax_scale=scale, causal=causal, block_table=block_table,
        return_softmax_lse=True, fa_version=get_flash_attn_version(head_size=q.shape[-1]),
    )  # fmt: skip


def attend_torch(q, k_pages, v_pages, cu_q, max_q, used_k, max_k, block_table, causal, scale):
    """attend_flash's contract in fp32 torch, one sequence at a time (the CPU's path, where
    vLLM's FlashAttention does not run)."""
    heads, kv_heads, page = q.shape[1], k_pages.shape[2], k_pages.shape[1]
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.full((heads, q.shape[0]), float("-inf"), device=q.device)
    cu, used = cu_q.tolist(), used_k.tolist()
    for seq, (start, end) in enumerate(itertools.pairwise(cu)):
        n, keys = end - start, used[seq]
        if not keys or not n:
            continue
        pages = block_table[seq, : -(-keys // page)].long()
        k = k_pages[pages].flatten(0, 1)[:keys].float().repeat_interleave(heads // kv_heads, 1)
        v = v_pages[pages].flatten(0, 1)[:keys].float().repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), k) * scale
        if causal:  # bottom right: query i sees keys up to i + keys - n
            allowed = torch.arange(keys)[None, :] <= torch.arange(n)[:, None] + keys - n
            scores = scores.masked_fill(~allowed.to(scores.device), float("-inf"))
        seq_lse = scores.logsumexp(-1)
        weights = (scores - seq_lse[..., None]).exp().nan_to_num(0.0)
        out[start:end] = torch.einsum("hqk,khd->qhd", weights, v).to(q.dtype)
        lse[:, start:end] = seq_lse
    return out, lse


def merge_into(acc, acc_lse, rows, out, lse) -> None:
    """acc[rows] (fp32 [n, Hq, D]) and acc_lse[:, rows] merged with a partial attention over
    other keys by log-sum-exp; an empty row (+inf from FA2, -inf from FA3) weighs nothing."""
    lse = torch.where(torch.isinf(lse), float("-inf"), lse.float())
    old = acc_lse[:, rows]
    top = torch.maximum(old, lse)
    top = torch.where(torch.isinf(top), 0.0, top)
    w_old, w_new = (old - top).exp(), (lse - top).exp()
    total = w_old + w_new
    safe = torch.where(total > 0, total, 1.0)
    keep, add = (w_old / safe).T[..., None], (w_new / safe).T[..., None]
    acc[rows] = acc[rows] * keep + out.float() * add
    acc_lse[:, rows] = torch.where(total > 0, top + total.log(), float("-inf"))


def prefill_by_dequantization(
    query: torch.Tensor,
    pool: torch.Tensor,
    side_k: torch.Tensor,
    side_v: torch.Tensor,
    host_slot_of_block: torch.Tensor,
    host_block_table: torch.Tensor,
    host_query_start_loc: list[int],
    host_seq_lens: list[int],
    rows: range,
    out: torch.Tensor,
    layout: TileLayout,
    scale: float | None = None,
    attend: Attend | None = None,
) -> torch.Tensor:
    """Attention of the chunks of requests `rows` (block-table rows; query_start_loc and
    seq_lens given as host lists over all rows) over the KVarN cache (module docstring), into
    their rows of out [num_tokens, Hq, D]. host_slot_of_block / host_block_table: the host's
    copies of the step's slot map and block table (the builder plans from them; the tiles'
    block ids go to the device per segment). attend:
    attend_flash on a CUDA device, attend_torch elsewhere, unless given."""
    groups = filling_groups(host_query_start_loc, host_seq_lens, rows)
    if not groups:
        return out
    device, tile = query.device, layout.tokens
    attend = attend or (attend_flash if device.type == "cuda" else attend_torch)
    scale = scale if scale is not None else 1 / math.sqrt(layout.head_dim)
    kv_heads = pool.shape[1]
    scratch = Scratch.get(kv_heads, layout.head_dim, tile, query.dtype, device)
    token_rows = torch.cat([torch.arange(g.first, g.first + g.count) for g in groups])
    index = token_rows.to(device)
    q = query[index]
    acc = torch.zeros(q.shape, dtype=torch.float32, device=device)
    acc_lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), device=device)
    offsets = torch.tensor([0, *[g.count for g in groups]]).cumsum(0).tolist()

    def run(picked, k_pages, v_pages, table_rows, used, causal):
        """One attend over the groups `picked` (indices into groups), merged into acc."""
        select = torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in picked])
        counts = [groups[i].count for i in picked]
        cu = torch.tensor([0, *counts]).cumsum(0).to(torch.int32)
        width = max(len(r) for r in table_rows)
        table = torch.zeros(len(picked), width, dtype=torch.int32)
        for i, pages in enumerate(table_rows):
            table[i, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        select_d = select.to(device)
        o, lse = attend(
            q[select_d], k_pages, v_pages, cu.to(device), max(counts),
            torch.tensor(used, dtype=torch.int32, device=device), max(used),
            table.to(device), causal, scale,
        )  # fmt: skip
        merge_into(acc, acc_lse, select_d, o, lse)

    # part A, segment by segment of the tiles below the groups' filling tiles
    for row in sorted({g.row for g in groups}):
        mine = [i for i, g in enumerate(groups) if g.row == row and g.filling > 0]
        top = max((groups[i].filling for i in mine), default=0)
        for first in range(0, top, SCRATCH_TILES):
            tiles = min(SCRATCH_TILES, top - first)
            blocks = host_block_table[row, first : first + tiles]
            dequantize_tiles(
                pool, blocks.to(device), layout,
                out=(scratch.key[:tiles], scratch.value[:tiles]),
            )  # fmt: skip
            sink_slot = int(host_slot_of_block[int(blocks[0])]) if first == 0 else -1
            if sink_slot >= 0:  # the sink is read in 16 bits while it has its slot
                scratch.key[0] = side_k[sink_slot]
                scratch.value[0] = side_v[sink_slot]
            picked = [i for i in mine if groups[i].filling > first]
            pages = [list(range(min(groups[i].filling, first + tiles) - first)) for i in picked]
            used = [tile * len(p) for p in pages]
            run(picked, scratch.key, scratch.value, pages, used, causal=False)

    # part B: each group's filling tile, from its side slot, up to each query
    picked = [i for i, g in enumerate(groups) if g.last_context > tile * g.filling]
    slots = []
    for i in picked:
        block = int(host_block_table[groups[i].row, groups[i].filling])
        slot = int(host_slot_of_block[block])
        if slot < 0:
            raise RuntimeError(f"KV=kvarn: filling block {block} has no side slot")
        slots.append([slot])
    used = [groups[i].last_context - tile * groups[i].filling for i in picked]
    if picked:
        run(picked, side_k, side_v, slots, used, causal=True)
    out[index] = acc.to(out.dtype)
    return out

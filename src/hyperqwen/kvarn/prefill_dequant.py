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
from hyperqwen.kvarn.queued import queued_copy
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


@dataclass(frozen=True)
class Attendance:
    """One attend call over some groups: `select`, their query rows among the plan's; the
    rest are attend's arguments (cu_q, max_q, used_k, max_k, block_table, causal)."""

    select: torch.Tensor
    cu_q: torch.Tensor
    max_q: int
    used_k: torch.Tensor
    max_k: int
    table: torch.Tensor
    causal: bool


@dataclass(frozen=True)
class Segment:
    """Part A over one segment of a request's context: its tiles' pool blocks (dequantized
    into the scratch's first pages), the sink's side slot where the segment starts at the
    sink and the sink has one (-1: none), and the attend call over the scratch."""

    blocks: torch.Tensor
    sink_slot: int
    attendance: Attendance


@dataclass(frozen=True)
class PrefillPlan:
    """What a step's prefill reads, the same for each layer: `index`, the prefill rows of the
    step's query tensor (device, int64); part A's segments; part B's attend call over the
    side slots (None when no query has a token of its filling tile before it)."""

    index: torch.Tensor
    segments: tuple[Segment, ...]
    filling: Attendance | None


class _Staging:
    """Host int32 lists gathered for one copy to the device (queued: kvarn/queued.py), each
    handed back as a view of the copy."""

    def __init__(self) -> None:
        self.parts: list[torch.Tensor] = []

    def add(self, values) -> int:
        self.parts.append(torch.as_tensor(values, dtype=torch.int32).reshape(-1))
        return len(self.parts) - 1

    def send(self, device) -> list[torch.Tensor]:
        host = torch.cat(self.parts)
        sent = queued_copy(host, torch.empty_like(host, device=device))
        return list(sent.split([len(part) for part in self.parts]))


def plan_prefill(
    host_slot_of_block: torch.Tensor,
    host_block_table: torch.Tensor,
    host_query_start_loc: list[int],
    host_seq_lens: list[int],
    rows: range,
    tile: int,
    device,
) -> PrefillPlan | None:
    """The step's PrefillPlan for the chunks of requests `rows` (block-table rows;
    query_start_loc and seq_lens as host lists over all rows), from the host's slot map and
    block table, or None without a query: host work and one queued copy, no wait for the
    device. The backend plans once per step for all layers."""
    groups = filling_groups(host_query_start_loc, host_seq_lens, rows)
    if not groups:
        return None
    staging = _Staging()
    index = staging.add(torch.cat([torch.arange(g.first, g.first + g.count) for g in groups]))
    offsets = torch.tensor([0, *[g.count for g in groups]]).cumsum(0).tolist()

    def attendance(picked, table_rows, used, causal):
        """An attend call over the groups `picked` (indices into groups), its tensors staged:
        returns what makes its Attendance from the sent views."""
        counts = [groups[i].count for i in picked]
        width = max(len(r) for r in table_rows)
        table = torch.zeros(len(picked), width, dtype=torch.int32)
        for i, pages in enumerate(table_rows):
            table[i, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        select = staging.add(torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in picked]))
        cu_q = staging.add(torch.tensor([0, *counts]).cumsum(0))
        used_k, table_at = staging.add(used), staging.add(table)
        return lambda sent: Attendance(
            sent[select], sent[cu_q], max(counts), sent[used_k], max(used),
            sent[table_at].view(-1, width), causal,
        )  # fmt: skip

    # part A, segment by segment of the tiles below the groups' filling tiles
    segments = []
    for row in sorted({g.row for g in groups}):
        mine = [i for i, g in enumerate(groups) if g.row == row and g.filling > 0]
        top = max((groups[i].filling for i in mine), default=0)
        for first in range(0, top, SCRATCH_TILES):
            tiles = min(SCRATCH_TILES, top - first)
            blocks = host_block_table[row, first : first + tiles]
            sink_slot = int(host_slot_of_block[int(blocks[0])]) if first == 0 else -1
            picked = [i for i in mine if groups[i].filling > first]
            pages = [list(range(min(groups[i].filling, first + tiles) - first)) for i in picked]
            used = [tile * len(p) for p in pages]
            segments.append((staging.add(blocks), sink_slot,
                             attendance(picked, pages, used, causal=False)))  # fmt: skip

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
    filling = attendance(picked, slots, used, causal=True) if picked else None

    sent = staging.send(device)
    parts = tuple(Segment(sent[blocks], slot, make(sent)) for blocks, slot, make in segments)
    return PrefillPlan(sent[index].long(), parts, filling(sent) if filling else None)


def prefill_by_dequantization(
    query: torch.Tensor,
    pool: torch.Tensor,
    side_k: torch.Tensor,
    side_v: torch.Tensor,
    plan: PrefillPlan | None,
    out: torch.Tensor,
    layout: TileLayout,
    scale: float | None = None,
    attend: Attend | None = None,
) -> torch.Tensor:
    """Attention of the prefill rows that `plan` (plan_prefill's) names over the KVarN cache
    (module docstring), into those rows of out [num_tokens, Hq, D]; nothing without a plan.
    attend: attend_flash on a CUDA device, attend_torch elsewhere, unless given. Queues
    device work only."""
    if plan is None:
        return out
    device = query.device
    attend = attend or (attend_flash if device.type == "cuda" else attend_torch)
    scale = scale if scale is not None else 1 / math.sqrt(layout.head_dim)
    scratch = Scratch.get(pool.shape[1], layout.head_dim, layout.tokens, query.dtype, device)
    q = query[plan.index]
    acc = torch.zeros(q.shape, dtype=torch.float32, device=device)
    acc_lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), device=device)

    def run(call: Attendance, k_pages, v_pages) -> None:
        o, lse = attend(
            q[call.select], k_pages, v_pages, call.cu_q, call.max_q, call.used_k, call.max_k,
            call.table, call.causal, scale,
        )  # fmt: skip
        merge_into(acc, acc_lse, call.select, o, lse)

    for segment in plan.segments:
        tiles = segment.blocks.shape[0]
        dequantize_tiles(pool, segment.blocks, layout,
                         out=(scratch.key[:tiles], scratch.value[:tiles]))  # fmt: skip
        if segment.sink_slot >= 0:  # the sink is read in 16 bits while it has its slot
            scratch.key[0] = side_k[segment.sink_slot]
            scratch.value[0] = side_v[segment.sink_slot]
        run(segment.attendance, scratch.key, scratch.value)
    if plan.filling is not None:
        run(plan.filling, side_k, side_v)
    out[plan.index] = acc.to(out.dtype)
    return out

"""The device tensors a step's KVarN metadata hands the layers, written by one copy and one
kernel per build (the builder runs four times a step: the verify and each drafter pass).

From the host's plan (slots.py: the slot map and the candidate tiles to store) and the
device's batch (vLLM's slot mapping, exact sequence lengths and query starts), each build
writes:
  slot_of_block  int32 [num_blocks]: the plan's slot map
  side_rows      int64 [num_tokens]: token i's row of the side cache, slot * 128 + offset,
                 or `padding_row` for a padding token (slot mapping -1) or a block without a
                 slot (never, by the plan), not a negative row that would index from the end
  store_blocks   int64 [stores]: a candidate tile's pool block where the device's exact
                 lengths say this step filled it (its end in (seq_len - query_len, seq_len]),
                 else -1 (the store skips it); -1 past the candidates
  store_slots    int64 [stores]: the candidates' slots
The host sends the slot map and the candidate lists in one int32 tensor from pinned memory
(queued.queued_copy: no wait for the device's queue) into a staging buffer, and one kernel
derives the rest there: as torch operations the same work was about thirty small launches a
build, host time that the H200 profile of a C1 step showed (docs/long-context.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from hyperqwen.kvarn.layout import TILE_TOKENS
from hyperqwen.kvarn.queued import queued_copy

CANDIDATE_LISTS = 4  # blocks, slots, batch rows, tile ends
STEP_BLOCK = 1024  # entries per program


class StepBuffers:
    """The device tensors a step's metadata hands the layers, allocated once per builder: a
    CUDA graph captured over the layers' forward reads them at the addresses it was captured
    with, so every build writes into them, queued behind the previous step's kernels.
    side_rows takes one entry per token of a step (at most max_num_batched_tokens, vLLM's
    runner and drafter alike); the store lists one per candidate tile (each holds a slot, so
    at most the slots) or per request, the padded length of a decode batch (backend.py).
    `staged` receives each build's host lists: the slot map, then the four candidate lists."""

    def __init__(self, num_blocks: int, num_slots: int, vllm_config, device) -> None:
        scheduler = vllm_config.scheduler_config
        self.stores = max(num_slots, scheduler.max_num_seqs)
        self.slot_of_block = torch.full((num_blocks,), -1, dtype=torch.int32, device=device)
        self.side_rows = torch.empty(scheduler.max_num_batched_tokens, dtype=torch.int64,
                                     device=device)  # fmt: skip
        self.store_blocks = torch.empty(self.stores, dtype=torch.int64, device=device)
        self.store_slots = torch.empty(self.stores, dtype=torch.int64, device=device)
        staged = num_blocks + CANDIDATE_LISTS * self.stores
        self.staged = torch.empty(staged, dtype=torch.int32, device=device)


def host_lists(slot_of_block: torch.Tensor, candidates: Sequence[Sequence[int]], stores: int):
    """The one int32 host tensor a build sends: the slot map, then each candidate list padded
    to `stores` entries (blocks with -1: skipped; the rest with 0)."""
    num_blocks, count = slot_of_block.shape[0], len(candidates[0])
    host = torch.zeros(num_blocks + CANDIDATE_LISTS * stores, dtype=torch.int32)
    host[:num_blocks] = slot_of_block
    lists = host[num_blocks:].view(CANDIDATE_LISTS, stores)
    lists[0] = -1
    if count:
        lists[:, :count] = torch.tensor(candidates, dtype=torch.int32)
    return host


def write_step_tensors(buffers: StepBuffers, plan, mapping: torch.Tensor,
                       seq_lens: torch.Tensor, query_start_loc: torch.Tensor, stores: int,
                       padding_row: int):  # fmt: skip
    """This build's (slot_of_block, side_rows, store_blocks, store_slots), views of `buffers`
    (the module docstring): `plan` the allocator's (slot_of_block, store_blocks, store_slots,
    store_rows, store_ends), `mapping` vLLM's slot mapping (int64, -1 for padding),
    seq_lens / query_start_loc the device's (int32), `stores` the store lists' length."""
    num_blocks, num_tokens = buffers.slot_of_block.shape[0], mapping.shape[0]
    if plan.slot_of_block.shape[0] != num_blocks:
        raise RuntimeError(
            f"KV=kvarn: the slot allocator maps {plan.slot_of_block.shape[0]} pool blocks, "
            f"the builder's buffer {num_blocks}: a block id past the pool's size reached the "
            "plan"
        )
    if not len(plan.store_blocks) <= stores <= buffers.stores:
        raise RuntimeError(
            f"KV=kvarn: {len(plan.store_blocks)} store candidates in lists of {stores}, "
            f"buffers of {buffers.stores} (StepBuffers)"
        )
    candidates = [plan.store_blocks, plan.store_slots, plan.store_rows, plan.store_ends]
    host = host_lists(plan.slot_of_block, candidates, stores)
    staged = queued_copy(host, buffers.staged[: host.shape[0]])
    side_rows = buffers.side_rows[:num_tokens]
    store_blocks, store_slots = buffers.store_blocks[:stores], buffers.store_slots[:stores]
    entries = max(num_blocks, num_tokens, stores)
    _step_tensors_kernel[(triton.cdiv(entries, STEP_BLOCK),)](
        staged, mapping, seq_lens, query_start_loc,
        buffers.slot_of_block, side_rows, store_blocks, store_slots,
        num_blocks, num_tokens, stores, padding_row,
        T=TILE_TOKENS, BLOCK=STEP_BLOCK,
    )  # fmt: skip
    return buffers.slot_of_block, side_rows, store_blocks, store_slots


# the sizes change from build to build (a prefill chunk's tokens, the candidates): one
# compiled kernel for all, not a variant per value Triton would specialize on (1, multiples
# of 16) compiled while serving
@triton.jit(do_not_specialize=["num_blocks", "num_tokens", "stores", "padding_row"])
def _step_tensors_kernel(staged_ptr, mapping_ptr, seq_lens_ptr, query_start_ptr,
                         slot_of_block_ptr, side_rows_ptr, store_blocks_ptr, store_slots_ptr,
                         num_blocks, num_tokens, stores, padding_row,
                         T: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """Entries pid * BLOCK ... of all three outputs; side rows read the slot map from the
    staged copy, which every program has, not from slot_of_block, which others write."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_map = i < num_blocks
    tl.store(slot_of_block_ptr + i, tl.load(staged_ptr + i, mask=in_map), mask=in_map)

    is_token = i < num_tokens
    slot_id = tl.load(mapping_ptr + i, mask=is_token, other=-1).to(tl.int64)
    block = tl.maximum(slot_id, 0) // T
    slot = tl.load(staged_ptr + block, mask=is_token & (slot_id >= 0), other=-1).to(tl.int64)
    row = tl.where((slot_id >= 0) & (slot >= 0), slot * T + slot_id % T, padding_row)
    tl.store(side_rows_ptr + i, row, mask=is_token)

    is_store = i < stores
    lists = staged_ptr + num_blocks
    blocks = tl.load(lists + i, mask=is_store, other=-1)
    named = is_store & (blocks >= 0)
    slots = tl.load(lists + stores + i, mask=is_store, other=0)
    batch_row = tl.load(lists + 2 * stores + i, mask=named, other=0)
    end = tl.load(lists + 3 * stores + i, mask=named, other=0)
    after = tl.load(seq_lens_ptr + batch_row, mask=named, other=0)
    query_len = tl.load(query_start_ptr + batch_row + 1, mask=named, other=0) - tl.load(
        query_start_ptr + batch_row, mask=named, other=0
    )
    filled = named & (after - query_len < end) & (end <= after)
    tl.store(store_blocks_ptr + i, tl.where(filled, blocks, -1).to(tl.int64), mask=is_store)
    tl.store(store_slots_ptr + i, slots.to(tl.int64), mask=is_store)

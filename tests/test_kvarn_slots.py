"""The side cache's slot allocator (kvarn/slots.py) and its sizing (kvarn/sizing.py), on the
host: pinned filling tiles, stores from the right slot, sinks cached past their request with
LRU eviction, fresh blocks dropping stale copies, recycled block ids, orphans reclaimed and a
lost tile refused; the slot count covering the worst step, the 27B's bytes."""

from __future__ import annotations

import pytest
import torch

from hyperqwen.kvarn.sizing import (
    SINK_SLOTS_PER_SEQ,
    serving_side_slots,
    side_cache_bytes,
    side_slots,
)
from hyperqwen.kvarn.slots import LostTileError, OutOfSlotsError, RequestStep, SlotAllocator

T = 128


def step(allocator, *requests):
    """requests: (blocks, before, after[, rejectable, final]) each."""
    return allocator.plan([RequestStep(*request) for request in requests])


def test_a_filling_tile_keeps_its_slot_until_the_step_that_fills_it_then_frees_it():
    slots = SlotAllocator(4, num_blocks=8)
    first = step(slots, ([5, 6], 0, 100))
    sink = int(first.slot_of_block[5])
    assert sink >= 0 and first.store_blocks == []
    second = step(slots, ([5, 6], 100, T + 10))  # fills the sink, starts block 6
    assert int(second.slot_of_block[5]) == sink
    assert second.store_blocks == [5] and second.store_slots == [sink]
    filling = int(second.slot_of_block[6])
    assert filling not in (-1, sink)
    third = step(slots, ([5, 6, 7], T + 10, 2 * T + 1))  # fills block 6
    assert third.store_blocks == [6] and third.store_slots == [filling]
    assert int(third.slot_of_block[6]) == filling, "the store of this step reads it"
    fourth = step(slots, ([5, 6, 7], 2 * T + 1, 2 * T + 2))
    assert int(fourth.slot_of_block[6]) == -1, "free the step after its store"
    assert int(fourth.slot_of_block[5]) == sink, "the sink stays"
    assert filling in slots.free


def test_a_prefill_chunk_holds_a_slot_for_every_tile_it_writes_and_stores_the_full_ones():
    slots = SlotAllocator(6, num_blocks=10)
    plan = step(slots, ([9, 3, 4, 8], 0, 3 * T + 5))
    assert plan.store_blocks == [9, 3, 4]
    assert len({*plan.store_slots, int(plan.slot_of_block[8])}) == 4
    assert all(int(plan.slot_of_block[b]) >= 0 for b in (9, 3, 4, 8))
    nxt = step(slots, ([9, 3, 4, 8], 3 * T + 5, 3 * T + 6))
    assert [int(nxt.slot_of_block[b]) for b in (3, 4)] == [-1, -1]
    assert int(nxt.slot_of_block[9]) >= 0 and int(nxt.slot_of_block[8]) >= 0


def test_a_sink_outlives_its_request_and_serves_a_prefix_hit():
    slots = SlotAllocator(4, num_blocks=8)
    step(slots, ([2, 3], 0, T + 4))
    sink = slots.slot(2)
    # the request ends; another hits its first block in the prefix cache
    plan = step(slots, ([2, 7], T, T + 30))
    assert int(plan.slot_of_block[2]) == sink
    assert int(plan.slot_of_block[7]) >= 0 and plan.store_blocks == []


def test_sinks_are_evicted_least_recently_used_and_a_step_never_evicts_its_own_tiles():
    slots = SlotAllocator(3, num_blocks=16)
    step(slots, ([0], 0, T))  # sink of block 0
    step(slots, ([1], 0, T))  # sink of block 1
    step(slots, ([2], 0, T))  # sink of block 2: all three slots are sinks
    step(slots, ([0, 9], T, T + 1))  # reading sink 0 makes it recent; block 9 evicts sink 1
    assert slots.slot(1) == -1 and slots.slot(0) >= 0 and slots.slot(2) >= 0
    plan = step(slots, ([3, 4], 0, 2 * T))  # two fresh tiles: evict sink 2, then sink 0? no:
    # block 9 is pinned (its request lives), the sinks go first: 2 then 0
    assert int(plan.slot_of_block[0]) == -1 and int(plan.slot_of_block[2]) == -1
    assert int(plan.slot_of_block[9]) >= 0
    assert plan.store_blocks == [3, 4]


def test_a_block_written_fresh_drops_its_old_copy():
    """Block 5 was a cached sink; vLLM evicts it from the prefix cache and hands it to another
    request as its block 1: the old sink copy must not survive under the new content."""
    slots = SlotAllocator(4, num_blocks=8)
    step(slots, ([5], 0, T))
    old = slots.slot(5)
    plan = step(slots, ([6, 5], 0, T + 3))
    new = int(plan.slot_of_block[5])
    assert new >= 0 and slots.block_of_slot[new] == 5
    assert old == new or slots.block_of_slot[old] != 5
    assert sorted(s for s in range(4) if slots.block_of_slot[s] == 5) == [new]


def test_a_recycled_partial_block_gets_a_fresh_slot_and_an_orphan_is_reclaimed():
    slots = SlotAllocator(2, num_blocks=8)
    step(slots, ([4, 5], 0, T + 20))  # ends with block 5 partial: an orphan once it ends
    assert slots.slot(4) >= 0 and slots.slot(5) >= 0
    # a new request gets block 5 fresh as its sink: the orphan's slot goes, not anything live
    plan = step(slots, ([5], 0, 10))
    assert int(plan.slot_of_block[5]) >= 0
    # with the slots full (sink of 4, block 5), a third block evicts the sink first
    plan = step(slots, ([5, 6], 10, T + 1))
    assert int(plan.slot_of_block[4]) == -1 and int(plan.slot_of_block[6]) >= 0


def test_an_old_orphan_goes_before_a_cached_sink_and_a_young_one_after():
    slots = SlotAllocator(3, num_blocks=16, orphan_after_steps=5)
    step(slots, ([1], 0, T))  # step 1: a cached sink
    step(slots, ([2], 0, 40))  # step 2: its request ends mid-tile, an orphan from here on
    step(slots, ([3], 0, 40))  # step 3: a live request mid-tile; all 3 slots in use
    step(slots, ([3], 40, 41), ([4], 0, 1))  # step 4: the orphan is 2 steps old: the sink goes
    assert (slots.slot(1), slots.slot(2) >= 0, slots.slot(4) >= 0) == (-1, True, True)
    step(slots, ([3], 41, 42), ([4], 1, T))  # step 5: block 4 becomes a cached sink
    step(slots, ([3], 42, 43))
    step(slots, ([3], 43, 44))
    step(slots, ([3], 44, 45), ([5], 0, 1))  # step 8: the orphan is 6 steps old: it goes
    assert slots.slot(2) == -1
    assert min(slots.slot(3), slots.slot(4), slots.slot(5)) >= 0


def test_a_reclaimed_live_tile_is_refused_not_read():
    slots = SlotAllocator(1, num_blocks=8)
    step(slots, ([1], 0, 50))  # a request paused mid-tile
    step(slots, ([2], 0, 10))  # another takes the only slot: block 1 looked orphaned
    with pytest.raises(LostTileError, match="block 1"):
        step(slots, ([1], 50, 51))


def test_a_step_larger_than_the_cache_is_refused():
    slots = SlotAllocator(2, num_blocks=8)
    with pytest.raises(OutOfSlotsError, match="more than 2 tiles"):
        step(slots, ([1, 2, 3], 0, 2 * T + 1))


def test_the_map_grows_to_cover_block_ids_and_plans_are_snapshots():
    slots = SlotAllocator(1)
    plan = step(slots, ([40], 0, 3))
    assert plan.slot_of_block.shape[0] >= 41 and int(plan.slot_of_block[40]) == 0
    step(slots, ([41], 0, 3))  # takes block 40's slot (its request looks ended)
    assert slots.slot(40) == -1 and slots.slot(41) == 0
    assert int(plan.slot_of_block[40]) == 0, "a plan's map is not changed by later steps"


@pytest.mark.parametrize(
    ("seqs", "tokens", "sinks", "expected"),
    [(1, 1, 0, 3), (4, 512, 4, 4 + 8 + 4), (256, 8192, 64, 64 + 512 + 64), (2, 129, 1, 2 + 4 + 1)],
)
def test_side_slots_covers_every_step_plus_the_sinks(seqs, tokens, sinks, expected):
    assert side_slots(seqs, tokens, sinks) == expected


def test_side_slots_suffice_for_the_worst_step():
    """The bound's worst case: every request starts its chunk at the last token of a tile
    and the budget is spread over them, with every other live request mid-tile."""
    seqs, tokens = 4, 3 * T
    slots = SlotAllocator(side_slots(seqs, tokens, 0), num_blocks=64)
    live = [([10 + 8 * r + b for b in range(8)], T - 1) for r in range(seqs)]
    step(slots, *[(blocks, 0, before) for blocks, before in live])
    budget = [tokens // 2, tokens - tokens // 2, 0, 0]  # two scheduled, two paused
    scheduled = [(blocks, b, b + q) for (blocks, b), q in zip(live, budget, strict=True) if q]
    step(slots, *scheduled)


def test_the_serving_cache_of_the_27b_is_small():
    """At 16 attention layers of 4 KV heads of 256, a slot is 8 MiB over all layers: 8
    sequences at 8192 batched tokens hold 64 + 16 + 16 slots."""
    slots = serving_side_slots(8, 8192)
    assert slots == 64 + 16 + 8 * SINK_SLOTS_PER_SEQ
    per_slot = side_cache_bytes(1, 4, 256, 16) - side_cache_bytes(0, 4, 256, 16)
    assert per_slot == 8 << 20
    assert side_cache_bytes(slots, 4, 256, 16) == slots * per_slot + side_cache_bytes(0, 4, 256, 16)


def test_speculating_a_sequence_takes_a_slot_more():
    """A filled tile stays pinned until its drafts are known accepted (slots.py)."""
    assert side_slots(4, 512, 4, speculative=True) == side_slots(4, 512, 4) + 4
    assert serving_side_slots(8, 8192, speculative=True) == serving_side_slots(8, 8192) + 8


def test_side_slots_refuses_nonsense():
    with pytest.raises(ValueError, match="max_num_seqs=0"):
        side_slots(0, 10, 1)


@pytest.mark.parametrize("drafts", [0, 3])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_scheduler_like_workload_never_runs_out_or_loses_a_tile(seed, drafts):
    """vLLM-like traffic at side_slots(8, 1024, 16): requests arrive with random prompts and
    outputs, running ones are scheduled in order (prefill chunks up to the token budget,
    decodes of one token, or with `drafts` verify blocks of 1 + drafts of which a random
    number is accepted), some wait a step when the budget runs out, finished ones free
    their blocks to the back of a FIFO free list, so block ids come back. Speculating, the
    planner sees the host's counts as async scheduling gives them (backend.py): ahead of the
    device's by the rejections of the request's step just before, if it ran. Each step: no
    OutOfSlotsError or LostTileError, every tile the device writes holds its own slot, and
    the map and the slots' owners agree."""
    g = torch.Generator().manual_seed(seed)

    def rand(low, high):
        return int(torch.randint(low, high + 1, (1,), generator=g))

    seqs, budget_tokens, pool = 8, 1024, 400
    total_slots = side_slots(seqs, budget_tokens, 2 * seqs, speculative=drafts > 0)
    slots = SlotAllocator(total_slots, num_blocks=pool)
    free_blocks = list(range(pool))
    running, waiting = [], []  # [blocks, computed (the device's), prompt, total, ahead]
    finished = 0
    for _ in range(1500):
        if rand(0, 1) == 0:
            prompt = rand(1, 3000)
            waiting.append([[], 0, prompt, prompt + rand(1, 200), 0])
        budget, scheduled = budget_tokens - rand(0, 300), []  # other work takes some budget
        for request in running + waiting[: seqs - len(running)]:
            if budget == 0:
                break
            blocks, computed, prompt, total, ahead = request
            verify = computed >= prompt
            wanted = 1 + drafts if verify else min(prompt - computed, total - computed)
            step_tokens = min(wanted, budget)
            host_after = computed + ahead + step_tokens
            need = -(-(host_after + drafts) // T) - len(blocks)  # vLLM's lookahead: drafts
            if need > len(free_blocks):
                continue
            blocks += [free_blocks.pop(0) for _ in range(need)]
            budget -= step_tokens
            scheduled.append((request, computed, computed + step_tokens))
            if request not in running:
                waiting.remove(request)
                running.append(request)
        host_steps = []
        for request, before, after in scheduled:
            host_before = before + request[4]
            host = (list(request[0]), host_before, host_before + after - before)
            if drafts and after - before <= 1 + drafts:
                host += (drafts, max(host_before - drafts, 0) + 1)
            host_steps.append(host)
        plan = step(slots, *host_steps)
        used = []
        for request, before, after in scheduled:
            for position in range(before // T, -(-after // T)):
                slot = int(plan.slot_of_block[request[0][position]])
                assert slot >= 0 and slots.block_of_slot[slot] == request[0][position]
                used.append(slot)
        assert len(used) == len(set(used))
        for request in running:  # the host knows the true count unless it ran just now
            request[4] = 0
        for request, before, after in scheduled:
            is_verify = drafts and before >= request[2]
            accepted = rand(1, after - before) if is_verify else after - before
            request[1], request[4] = before + accepted, after - before - accepted
            if request[1] >= request[3]:
                request[1] = request[3]
        for block in range(len(plan.slot_of_block)):
            slot = int(plan.slot_of_block[block])
            assert slot < 0 or slots.block_of_slot[slot] == block
        for request in [r for r in running if r[1] >= r[3]]:
            running.remove(request)
            free_blocks += request[0]
            finished += 1
    assert finished > 30  # enough block ids come back

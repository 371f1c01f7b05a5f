"""Failure modes other KV-cache quantizers have shipped (issue 25 item 3), tested on KVarN's
store kernel, read rule and decode kernel (CPU interpreter, small shapes), with caches built
like the backend's (tests/kvarn_cache.py: every byte outside the read plan poisoned):

- zeroing a block on allocation corrupts a live block another request shares under prefix
  caching: KVarN's kernels read nothing outside the plan, so nothing needs zeroing; a request
  that shares another's prefix blocks and stores its own leaves the other's bytes and output
  unchanged;
- a late flush of a freed request's partial tile lands in the page's next owner: a tile is
  stored only in the step that fills it (attention.blocks_to_store), so a freed request leaves
  no write behind; its side slot and pool block, recycled through the slot allocator
  (slots.py) to another request, show that request none of the stale tokens;
- the verify read path under speculation: a tile filled by drafts that are then rejected is
  stale; shorter contexts must not read it, and the step that fills it again stores it again.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kvarn_cache import POISON_BYTE, Cache, T, build_cache
from kvarn_data import outlier_keys, outlier_values

from hyperqwen.bench.kernels import relative_error
from hyperqwen.kvarn.attention import blocks_to_store
from hyperqwen.kvarn.decode import decode_attention
from hyperqwen.kvarn.layout import TileLayout
from hyperqwen.kvarn.slots import RequestStep, SlotAllocator
from hyperqwen.kvarn.store import store_tiles

pytestmark = pytest.mark.usefixtures("interpreted")
HEADS, KV_HEADS, D = 4, 2, 64
BOUND = 8e-3  # tests/test_kvarn_decode.py's bf16 bound


def decode(cache, num_splits=2):
    out = torch.full_like(cache.query, float("nan"))
    return decode_attention(cache.query, **cache.kernel_args(), num_splits=num_splits, out=out)


def assert_matches_reference(cache, out):
    expected = cache.expected()
    for row in range(out.shape[0]):
        assert relative_error(out[row], expected[row]) < BOUND, row


def with_poisoned_blocks(tensor, count, poison):
    return torch.cat((tensor, torch.full((count, *tensor.shape[1:]), poison, dtype=tensor.dtype)))


@pytest.mark.parametrize(
    ("before", "after", "stored"),
    [(0, 1000, [0, 1, 2, 3, 4, 5, 6]), (100, 200, [0]), (300, 301, []), (383, 384, [2]),
     (382, 386, [2]), (384, 384, []), (0, T, [0]), (0, T - 1, [])],
)  # fmt: skip
def test_a_step_stores_the_tiles_it_fills_the_sink_included(before, after, stored):
    assert list(blocks_to_store(before, after)) == stored


def test_blocks_to_store_refuses_a_step_backwards():
    with pytest.raises(ValueError, match="from 10 to 9 tokens"):
        blocks_to_store(10, 9)


@pytest.mark.parametrize("sink_in_side", [True, False])
def test_a_request_sharing_a_prefix_leaves_the_owner_unchanged(sink_in_side):
    """A (3 tiles + 10 tokens) owns the sink and pool blocks 1-3; B shares blocks 0-2 (a
    prefix-cache hit on 384 tokens, its sink with or without its 16-bit slot), fills block 3
    into a fresh poisoned pool block and has 20 filling tokens in a fresh block and side
    slot. Storing B's tile changes no other byte, and A's output in a batch with B is
    bit-identical to A's alone."""
    evicted = () if sink_in_side else (0,)
    a = build_cache([3 * T + 10], [1], HEADS, KV_HEADS, D, seed=61, evicted_sinks=evicted)
    alone = decode(a)
    new_k = outlier_keys(T + 20, KV_HEADS, D, seed=62)
    new_v = outlier_values(T + 20, KV_HEADS, D, seed=63)
    key_b = torch.cat((a.keys[0][: 3 * T], new_k))
    value_b = torch.cat((a.values[0][: 3 * T], new_v))

    pool = with_poisoned_blocks(a.pool, 2, POISON_BYTE)
    fresh_block, filling_block = pool.shape[0] - 2, pool.shape[0] - 1
    before = pool.clone()
    store_tiles(new_k[None, :T], new_v[None, :T], pool, torch.tensor([fresh_block]), a.layout)
    assert torch.equal(pool[:fresh_block], before[:fresh_block])

    side_k = with_poisoned_blocks(a.side_k, 1, float("nan"))
    side_v = with_poisoned_blocks(a.side_v, 1, float("nan"))
    fresh_side = side_k.shape[0] - 1
    side_k[fresh_side, :20], side_v[fresh_side, :20] = new_k[T:], new_v[T:]
    spare_block = int(a.block_table[0, -1])
    poisoned_side = int(a.slot_of_block[spare_block])
    # B's tile filled last step still holds a slot: the poisoned one, which must not be read
    slot_of_block = torch.cat(
        (a.slot_of_block, torch.tensor([poisoned_side, fresh_side], dtype=torch.int32))
    )

    block_table = torch.full((2, 6), spare_block, dtype=torch.int32)
    block_table[:, :4] = a.block_table[0, :4]
    block_table[1, 3:5] = torch.tensor([fresh_block, filling_block])
    query_b = torch.randn(1, HEADS, D, generator=torch.Generator().manual_seed(64))
    both = dataclasses.replace(
        a, keys=[a.keys[0], key_b], values=[a.values[0], value_b],
        query=torch.cat((a.query, query_b.bfloat16())), pool=pool, block_table=block_table,
        side_k=side_k, side_v=side_v, slot_of_block=slot_of_block,
        seq_lens=torch.tensor([3 * T + 10, 4 * T + 20], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32),
        evicted_sinks=frozenset(() if sink_in_side else (0, 1)),
    )  # fmt: skip
    out = decode(both)
    assert torch.equal(out[0], alone[0])
    assert_matches_reference(both, out)


def test_a_freed_requests_partial_tile_and_slot_never_reach_their_next_owner():
    """Steps planned by the slot allocator (3 slots), writing each new token into its tile's
    slot and storing what the plan names, as the backend does. A reaches 2 tiles + 70 tokens
    and ends mid-tile; its pool block 2 becomes B's block 1 (fresh), and B's tiles take A's
    freed slots, one still holding A's 70 stale tokens, then A's cached sink's slot (evicted).
    While B's block 1 fills, the recycled pool block keeps its bytes (no late flush of A's
    tile) and B reads none of A's stale tokens; once B fills it, it holds B's tile bit for
    bit as a fresh pool would."""
    layout = TileLayout(head_dim=D)
    pool = torch.full(layout.pool_shape(5, KV_HEADS), POISON_BYTE, dtype=torch.uint8)
    side_k = torch.full((3, T, KV_HEADS, D), float("nan"), dtype=torch.bfloat16)
    side_v = torch.full_like(side_k, float("nan"))
    slots = SlotAllocator(3, num_blocks=5)

    def step(keys, values, blocks, before, after):
        plan = slots.plan([RequestStep(blocks, before, after)])
        for position in range(before, after):
            slot = int(plan.slot_of_block[blocks[position // T]])
            side_k[slot, position % T] = keys[position]
            side_v[slot, position % T] = values[position]
        if plan.store_blocks:
            tiles = [side[plan.store_slots] for side in (side_k, side_v)]
            store_tiles(*tiles, pool, torch.tensor(plan.store_blocks), layout)
        return plan

    a = (outlier_keys(2 * T + 70, KV_HEADS, D, 71), outlier_values(2 * T + 70, KV_HEADS, D, 72))
    a_blocks = [4, 0, 2]
    step(*a, a_blocks, 0, 2 * T + 50)
    step(*a, a_blocks, 2 * T + 50, 2 * T + 70)
    recycled = pool[a_blocks[2]].clone()
    a_slots = {slots.slot(block) for block in a_blocks}

    b_keys, b_values = (
        outlier_keys(2 * T + 1, KV_HEADS, D, 73),
        outlier_values(2 * T + 1, KV_HEADS, D, 74),
    )
    b_blocks = [1, a_blocks[2], 3]
    g = torch.Generator().manual_seed(75)
    for before, after in ((0, T + 30), (T + 30, 2 * T + 1)):
        plan = step(b_keys, b_values, b_blocks, before, after)
        width = (after - 1) // T + 1
        cache = Cache(
            keys=[b_keys[:after]], values=[b_values[:after]],
            query=torch.randn(1, HEADS, D, generator=g).bfloat16(), pool=pool,
            block_table=torch.tensor([[*b_blocks[:width], 4]], dtype=torch.int32),
            side_k=side_k, side_v=side_v, slot_of_block=plan.slot_of_block,
            seq_lens=torch.tensor([after], dtype=torch.int32),
            query_start_loc=torch.tensor([0, 1], dtype=torch.int32), layout=layout,
        )  # fmt: skip
        assert_matches_reference(cache, decode(cache))
        if after < 2 * T:
            assert torch.equal(pool[b_blocks[1]], recycled), "a write before B filled block 1"
            b_slot = int(plan.slot_of_block[b_blocks[1]])
            assert b_slot in a_slots and side_k[b_slot, 30:70].isfinite().all(), (
                "B's filling tile is in a slot that still holds A's stale tokens"
            )
    assert int(plan.slot_of_block[a_blocks[0]]) == -1, "A's cached sink was evicted for B"
    fresh = torch.empty(layout.pool_shape(1, KV_HEADS), dtype=torch.uint8)
    tiles = [x[None, T : 2 * T] for x in (b_keys, b_values)]
    store_tiles(*tiles, fresh, torch.tensor([0]), layout)
    assert torch.equal(pool[b_blocks[1]], fresh[0])


def test_a_tile_of_rejected_drafts_is_not_read_and_is_stored_again_when_refilled():
    """A verify step of 4 queries at 3 tiles + 2 tokens (positions 382-385) filled block 2
    with a draft at 383 and stored it (blocks_to_store(382, 386) = [2]). The drafts are
    rejected: 383 tokens stand, and the next step writes another token at 383. The stale
    tile (poisoned here) must not be read at 383 tokens, and the step to 384 stores block 2
    again, which the decode at 384 then reads."""
    cache = build_cache([3 * T + 2], [4], HEADS, KV_HEADS, D, seed=81)
    assert list(blocks_to_store(382, 386)) == [2]
    stale = int(cache.block_table[0, 2])
    cache.pool[stale] = POISON_BYTE
    g = torch.Generator().manual_seed(82)
    key, value = cache.keys[0].clone(), cache.values[0].clone()
    key[383], value[383] = torch.randn(2, KV_HEADS, D, generator=g).bfloat16()
    side = int(cache.slot_of_block[stale])
    one_query = torch.tensor([0, 1], dtype=torch.int32)
    for length in (383, 384):
        if length == 384:  # the step that writes 383 and fills block 2 again
            cache.side_k[side, 127], cache.side_v[side, 127] = key[383], value[383]
            assert list(blocks_to_store(383, 384)) == [2]
            tiles = [x[None, 2 * T : 3 * T] for x in (key, value)]
            store_tiles(*tiles, cache.pool, torch.tensor([stale]), cache.layout)
        decoding = dataclasses.replace(
            cache, keys=[key[:length]], values=[value[:length]],
            query=torch.randn(1, HEADS, D, generator=g).bfloat16(),
            seq_lens=torch.tensor([length], dtype=torch.int32), query_start_loc=one_query,
        )  # fmt: skip
        assert_matches_reference(decoding, decode(decoding))

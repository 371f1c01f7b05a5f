"""The side cache's slot allocator: which 16-bit tile of the side cache holds which pool block.

The quantized pool is complete (every full tile, the sink included, is stored when it fills:
attention.blocks_to_store), so the side cache is a cache of 16-bit tiles over it, of
`num_slots` tiles, and `slot_of_block` (int32, one entry per pool block, -1 for none) says
where a block's 16-bit tile is. The allocator runs on the host, once per step, before the
step's kernels; the backend copies `slot_of_block` to the device for them.

Its rules (kvarn/README.md, "Design of the side-slot allocator"):
- Every tile a step writes tokens into (from before // 128 to (after - 1) // 128 of a request
  going from `before` to `after` tokens) holds a slot in that step: its new tokens go there,
  and the store quantizes the filled ones from there. A tile is pinned from its first token
  to the step whose store fills it; its slot is free the step after (the step's store runs
  before the next step's writes in stream order). Nothing is written back later, so no store
  can land in a page vLLM has handed to another request.
- A block written from its first token (fresh: no computed token in it) frees the slot it
  held: its content is being rewritten, so an old 16-bit copy of it is stale.
- A filled sink (block 0) keeps its slot past its step and past its request, so that later
  steps and prefix-cache hits read it in 16 bits; sinks are evicted least recently used when
  slots run out, and a sink without a slot is read from its quantized tile.
- Requests are followed by their block ids, never by runner rows, so the runner's row moves
  need nothing.

A request that ends with a partial tile leaves that tile pinned (the builder is not told
which requests ended: most requests end so). Such an orphan's slot is reclaimed when its block
is written fresh again, or when slots run out: first a pinned slot untouched for
ORPHAN_AFTER_STEPS steps (so orphans do not crowd the cached sinks out for long), then the
least recently used sink, then the least recently touched pinned slot. If a reclaimed tile
was a live request's after all (one not scheduled for that many steps), its next step finds
a partial tile without a slot and raises LostTileError rather than read stale data;
sizing.side_slots sizes the cache so that live tiles alone always fit.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hyperqwen.kvarn.quantize import TILE_TOKENS

# a pinned slot untouched this many steps is taken for an ended request's before any cached
# sink is evicted: vLLM schedules every running request each step unless the token budget
# runs out before it, so a live one waits a few steps at most
ORPHAN_AFTER_STEPS = 256


class LostTileError(RuntimeError):
    """A partial tile's 16-bit tokens are gone: its slot was reclaimed as an orphan's."""


class OutOfSlotsError(RuntimeError):
    """A step writes into more tiles than the side cache has slots."""


@dataclass(frozen=True)
class RequestStep:
    """One request in a step: its block ids (pool blocks of positions 0, 1, ..., at least up
    to the block of its last token) and its token count before and after the step."""

    blocks: Sequence[int]
    before: int
    after: int


@dataclass(frozen=True)
class StepSlots:
    """What a step's kernels need: the map after planning, and the tiles the step fills."""

    slot_of_block: torch.Tensor  # int32 [num_blocks], a copy: later steps do not change it
    store_blocks: list[int]  # pool blocks the step fills, in request order
    store_slots: list[int]  # their slots (the 16-bit tiles the store reads)


class SlotAllocator:
    def __init__(self, num_slots: int, num_blocks: int = 0, tile: int = TILE_TOKENS,
                 orphan_after_steps: int = ORPHAN_AFTER_STEPS) -> None:  # fmt: skip
        if num_slots < 1:
            raise ValueError(f"num_slots={num_slots}: the side cache needs at least one slot")
        self.num_slots, self.tile, self.orphan_after = num_slots, tile, orphan_after_steps
        self.step = 0
        self.slot_of_block = torch.full((num_blocks,), -1, dtype=torch.int32)
        self.block_of_slot = [-1] * num_slots
        self.free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self.sinks: OrderedDict[int, None] = OrderedDict()  # slot -> None, oldest first
        # slot -> the step that last wrote it, least recent first
        self.pinned: OrderedDict[int, int] = OrderedDict()
        self.release_next: list[int] = []
        self.in_step: set[int] = set()  # slots this step writes: never evicted within it

    def slot(self, block: int) -> int:
        return int(self.slot_of_block[block]) if block < len(self.slot_of_block) else -1

    def _cover(self, block: int) -> None:
        if block >= len(self.slot_of_block):
            size = max(block + 1, 2 * len(self.slot_of_block))
            grown = torch.full((size,), -1, dtype=torch.int32)
            grown[: len(self.slot_of_block)] = self.slot_of_block
            self.slot_of_block = grown

    def _release(self, slot: int) -> None:
        block = self.block_of_slot[slot]
        if block >= 0 and int(self.slot_of_block[block]) == slot:
            self.slot_of_block[block] = -1
        self.block_of_slot[slot] = -1
        self.sinks.pop(slot, None)
        self.pinned.pop(slot, None)
        self.free.append(slot)

    def _evictable(self, order: OrderedDict) -> int | None:
        return next((slot for slot in order if slot not in self.in_step), None)

    def _take(self, block: int) -> int:
        if not self.free:
            victim = next(iter(self.pinned), None)  # the least recently written
            if victim is None or self.step - self.pinned[victim] < self.orphan_after:
                victim = self._evictable(self.sinks)
            if victim is None:
                victim = self._evictable(self.pinned)
            if victim is None:
                raise OutOfSlotsError(
                    f"a step writes into more than {self.num_slots} tiles; size the side "
                    "cache with side_slots(max_num_seqs, max_num_batched_tokens, ...)"
                )
            self._release(victim)
        slot = self.free.pop()
        self._cover(block)
        self.slot_of_block[block] = slot
        self.block_of_slot[slot] = block
        return slot

    def plan(self, requests: Sequence[RequestStep]) -> StepSlots:
        """Assign the step's slots (module docstring) and return what its kernels need."""
        self.step += 1
        for slot in self.release_next:
            self._release(slot)
        self.release_next, self.in_step = [], set()
        store_blocks, store_slots, filled_sinks = [], [], []
        for request in requests:  # the step's sink reads first: recent, evicted last
            slot = self.slot(int(request.blocks[0])) if request.before >= self.tile else -1
            if slot in self.sinks:
                self.sinks.move_to_end(slot)
        for request in requests:
            before, after, tile = request.before, request.after, self.tile
            if not 0 <= before <= after or len(request.blocks) * tile < after:
                raise ValueError(
                    f"a step from {before} to {after} tokens over {len(request.blocks)} blocks"
                )
            for position in range(before // tile, -(-after // tile)):
                block = int(request.blocks[position])
                slot = self.slot(block)
                if before <= position * tile:  # fresh: any old copy of the block is stale
                    if slot >= 0:
                        self._release(slot)
                    slot = self._take(block)
                elif slot not in self.pinned:  # -1 included
                    raise LostTileError(
                        f"block {block} (position {position}) holds {before - position * tile} "
                        "tokens but its 16-bit tile has no slot: it was reclaimed as an "
                        "orphan's (a live request unscheduled for many steps?)"
                    )
                self.in_step.add(slot)
                self.pinned[slot] = self.step
                self.pinned.move_to_end(slot)
                if after >= (position + 1) * tile:  # this step's store fills it
                    store_blocks.append(block)
                    store_slots.append(slot)
                    (filled_sinks if position == 0 else self.release_next).append(slot)
        for slot in filled_sinks:
            self.pinned.pop(slot, None)
            self.sinks[slot] = None
            self.sinks.move_to_end(slot)
        return StepSlots(self.slot_of_block.clone(), store_blocks, store_slots)

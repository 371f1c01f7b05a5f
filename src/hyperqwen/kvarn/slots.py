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

Under speculative decoding the host knows a request's token counts only from above (vLLM's
`seq_lens_cpu_upper_bound` assumes every draft of the previous step accepted; kvarn/README.md,
"Speculative decoding"): the device may start up to `rejectable` tokens before `before`,
rewriting the rejected drafts' positions, possibly in the tile below. So a step holds a slot
for every tile the device may write (those below `before`'s tile only while still pinned: a
tile released as final is never written again), names every tile it may fill as a store
candidate (the backend stores a candidate only where the device's exact lengths say this step
filled it), and keeps a filled tile pinned until it is final: until a step's `final` (a lower
bound on the positions any later write reaches) passes its end. Without speculation
`rejectable` is 0 and `final` the step's `after`: a filled tile is final in the step that
fills it, as above.

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

from hyperqwen.kvarn.layout import TILE_TOKENS

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
    to the block of its last token) and its token count before and after the step, as the
    host knows them: exact, or, under speculation, upper bounds the device's counts may be up
    to `rejectable` below; `final`: positions below it are never written again from this step
    on (None: `after`, every token of the step final)."""

    blocks: Sequence[int]
    before: int
    after: int
    rejectable: int = 0
    final: int | None = None

    @property
    def lowest(self) -> int:
        """The lowest position the device may write in this step."""
        return max(self.before - self.rejectable, 0)


@dataclass(frozen=True)
class StepSlots:
    """What a step's kernels need: the map after planning, and the tiles the step fills."""

    slot_of_block: torch.Tensor  # int32 [num_blocks], a copy: later steps do not change it
    store_blocks: list[int]  # pool blocks the step may fill, in request order
    store_slots: list[int]  # their slots (the 16-bit tiles the store reads)
    store_rows: list[int]  # the request (its index in the step) of each
    store_ends: list[int]  # the position after each tile's last: filled once the length is here


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
        store_blocks, store_slots, store_rows, store_ends, filled_sinks = [], [], [], [], []
        for request in requests:  # the step's sink reads first: recent, evicted last
            slot = self.slot(int(request.blocks[0])) if request.before >= self.tile else -1
            if slot in self.sinks:
                self.sinks.move_to_end(slot)
        for row, request in enumerate(requests):
            before, after, tile = request.before, request.after, self.tile
            final = after if request.final is None else request.final
            if not 0 <= before <= after or len(request.blocks) * tile < after or final > after:
                raise ValueError(
                    f"a step from {before} to {after} tokens (final {final}) over "
                    f"{len(request.blocks)} blocks"
                )
            # one tile below the lowest write: a tile filled by the request's last step may be
            # final only now (the rejectable window is shorter than a tile)
            first = max(request.lowest // tile - 1, 0)
            for position in range(first, -(-after // tile)):
                block = int(request.blocks[position])
                slot = self.slot(block)
                end = (position + 1) * tile
                if before <= position * tile:  # fresh: any old copy of the block is stale
                    if slot >= 0:
                        self._release(slot)
                    slot = self._take(block)
                elif position == before // tile:
                    if slot not in self.pinned:  # -1 included
                        raise LostTileError(
                            f"block {block} (position {position}) holds "
                            f"{before - position * tile} tokens but its 16-bit tile has no "
                            "slot: it was reclaimed as an orphan's (a live request "
                            "unscheduled for many steps?)"
                        )
                elif slot not in self.pinned:  # below before's tile: final already, or cached
                    continue
                elif end <= request.lowest:  # not written now: only its finality is news
                    if end <= final:  # its last store ran in an earlier step: free it now
                        self._finalize_now(slot, position)
                    continue
                self.in_step.add(slot)
                self.pinned[slot] = self.step
                self.pinned.move_to_end(slot)
                if end <= after:  # this step may fill it: the store decides on the device
                    store_blocks.append(block)
                    store_slots.append(slot)
                    store_rows.append(row)
                    store_ends.append(end)
                    if end <= final:
                        self._settle(slot, position, filled_sinks)
        for slot in filled_sinks:
            self.pinned.pop(slot, None)
            self.sinks[slot] = None
            self.sinks.move_to_end(slot)
        return StepSlots(
            self.slot_of_block.clone(), store_blocks, store_slots, store_rows, store_ends
        )

    def _finalize_now(self, slot: int, position: int) -> None:
        """A tile this step does not touch is final (not in_step, so an eviction later in the
        plan could take its slot: settled at once, never through release_next)."""
        if position == 0:
            self.pinned.pop(slot, None)
            self.sinks[slot] = None
            self.sinks.move_to_end(slot)
        else:
            self._release(slot)

    def _settle(self, slot: int, position: int, filled_sinks: list[int]) -> None:
        """A filled tile is final: a sink joins the cached sinks (after the step's plan), any
        other tile's slot is free the step after (this step's store may still read it)."""
        if slot not in self.release_next and slot not in filled_sinks:
            (filled_sinks if position == 0 else self.release_next).append(slot)

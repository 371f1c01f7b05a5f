"""How big KVarN's 16-bit side cache is (its slots, slots.py, and bytes) and its prefill
scratch (prefill_dequant.py). Plain arithmetic, without torch, so that the launcher's
capacity arithmetic (../capacity.py) can use it.

Slots: a step's requests write into at most ceil(q / 128) + 1 tiles each (q tokens starting
mid-tile), at most max_num_batched_tokens / 128 + 2 n over its n requests; the live requests
it does not schedule keep one partial tile each, at most max_num_seqs - n. So
ceil(max_num_batched_tokens / 128) + 2 max_num_seqs slots never run out of live tiles, and
the cached sinks come on top: SINK_SLOTS_PER_SEQ per sequence, so every running request's
sink can be read in 16 bits with room for as many cached prefixes. Under speculative decoding
a request may also keep a filled tile pinned until its drafts are known accepted (slots.py), at
most one (the rejectable window is shorter than a tile), so an unscheduled request holds 2.
The sum above still covers that (a verify block of q <= 128 tokens touches at most 2 tiles,
its own unsettled one included, and ceil(q / 128) + 1 counts 2), but the cache takes one slot
more per sequence when speculating, 8 MiB over the 27B's layers: a margin for the drafter's
passes and the orphan reclaim, whose worst cases are not derived here.

Bytes: each full-attention layer's impl holds its own K and V tiles of every slot, 16 bits,
plus one row for the writes of padding tokens.
"""

from __future__ import annotations

import math

from hyperqwen.kvarn.layout import TILE_TOKENS

SINK_SLOTS_PER_SEQ = 2
SIDE_DTYPE_BYTES = 2  # the model's bf16 or fp16


def side_slots(
    max_num_seqs: int,
    max_num_batched_tokens: int,
    sink_slots: int,
    tile: int = TILE_TOKENS,
    speculative: bool = False,
) -> int:
    """Slots enough for any step (module docstring) plus `sink_slots` cached sinks."""
    if min(max_num_seqs, max_num_batched_tokens) < 1 or sink_slots < 0:
        raise ValueError(
            f"max_num_seqs={max_num_seqs}, max_num_batched_tokens={max_num_batched_tokens}, "
            f"sink_slots={sink_slots}: need at least one sequence and token, sinks >= 0"
        )
    per_seq = 3 if speculative else 2
    return math.ceil(max_num_batched_tokens / tile) + per_seq * max_num_seqs + sink_slots


def serving_side_slots(
    max_num_seqs: int, max_num_batched_tokens: int, speculative: bool = False
) -> int:
    """The slots the backend allocates for vLLM's scheduler limits."""
    sinks = SINK_SLOTS_PER_SEQ * max_num_seqs
    return side_slots(max_num_seqs, max_num_batched_tokens, sinks, speculative=speculative)


def side_cache_bytes(slots: int, kv_heads: int, head_dim: int, layers: int) -> int:
    """K and V of `slots` tiles and a padding row, 16 bits, in each of `layers` layers."""
    rows = slots * TILE_TOKENS + 1
    return 2 * rows * kv_heads * head_dim * SIDE_DTYPE_BYTES * layers


# the prefill scratch's tiles (prefill_dequant.py): 256 of 128 tokens (32k) hold one segment of
# a context, 128 MiB of bf16 K and V at the 27B's 4 KV heads of 256; a longer context takes
# more segments per chunk
SCRATCH_TILES = 256


def scratch_bytes(kv_heads: int, head_dim: int, tile: int = 128, itemsize: int = 2) -> int:
    """The prefill scratch's bytes, one for all layers: K and V of SCRATCH_TILES tiles."""
    return 2 * SCRATCH_TILES * tile * kv_heads * head_dim * itemsize

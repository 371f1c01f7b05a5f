"""A prompt that nothing cached in one prefill step, under prefix caching's mamba "align" mode.

vLLM 0.26 caches this hybrid model's GDN state only where a scheduler step ends, so its
scheduler (`Scheduler._mamba_block_aligned_split`) ends prefill chunks on cache-block boundaries
and stops every prompt at its last boundary (`last_cache_position`), leaving the rest of the
prompt to a second step. That stop keeps the state at the boundary for a later request sharing
the prompt up to there; it costs every prompt longer than one block an extra engine step, the
same whether or not any request ever shares it.

Here a chunk that starts at token 0 (no cache hit), for a request in which vLLM saw no uncached
shared prefix (`shared_prefix_boundary`, its Marconi-style junction), and that would finish the
request's tokens in this step if unsplit, runs whole. Its state then ends up where vLLM's own
tail step leaves it (a position past the last boundary, in the block holding the running state);
the blocks before it stay null, as the blocks inside any of vLLM's own multi-block chunks do, so
nothing is cached that a step did not end on. What is given up: the first request of a prompt
caches no state at its boundaries. A second request sharing a prefix finds the attention blocks
cached without a state, which is vLLM's junction: vLLM stops that request there and caches the
state, and later requests hit it. Requests that start from a cache hit keep vLLM's stops, so a
conversation's later turns still leave their states at block boundaries.
"""

from __future__ import annotations

from typing import Any


def scheduler_mamba_split(request: Any, start: int, wanted: int, split: int) -> int:
    """`wanted` where the chunk is a whole uncached, unshared prompt (see the module), else
    vLLM's `split`."""
    cold = start == 0 and not request.shared_prefix_boundary
    finishes = start + wanted >= request.num_tokens
    return wanted if cold and finishes else split

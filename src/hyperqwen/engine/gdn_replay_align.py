"""GDN replay under prefix caching's `align` mode: which folds stand in for vLLM's state copies.

vLLM 0.26 keeps the state after every verified token in a block of its own, and in `align`
mode copies two of them (engine/quoting.md, "GDN replay", item 4): after a step, the state at
a block boundary inside the accepted tokens into the block ending there, for the prefix cache
(`postprocess_mamba_fused_kernel`, v1/worker/mamba_utils.py); before a step, the running
state into the request's new block when the step's tokens reach into it (`preprocess_mamba`).
Under the replay verify the running block holds the state at its last verify's start and that
verify's inputs, so each copy becomes `gdn_replay_fold` of the source block's saved tokens
into the destination block (kernels/gdn_replay.py). This module computes those folds from
the same inputs vLLM's copies decide on, with tensor ops on the device (no host sync, as
vLLM's fused kernel). Not wired into vLLM's align path yet: the launcher refuses GDN_REPLAY
with prefix caching.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AlignFolds:
    """gdn_replay_fold's arguments for one step's requests (int32, one entry per request):
    sources (0, vLLM's null block: nothing to do), dests, counts; and `clears`, the requests
    whose running block itself received the boundary state, so their saved tokens are folded
    and the block's `saved` record must clear (vLLM resets their accepted count to 1)."""

    sources: torch.Tensor
    dests: torch.Tensor
    counts: torch.Tensor
    clears: torch.Tensor


def boundary_folds(
    num_accepted: torch.Tensor,
    state_idx: torch.Tensor,
    num_scheduled: torch.Tensor,
    num_computed: torch.Tensor,
    num_draft: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
) -> AlignFolds:
    """The folds that replace the temporal-state copies of vLLM's `align` postprocess after a
    step, from its inputs: per request its accepted tokens, its running block's column in its
    block table row (vLLM's mamba_state_idx), the step's scheduled, computed-before and draft
    tokens. vLLM copies the state after token `bias` of the step (column state_idx + bias)
    into the block that ends at the last block boundary the accepted tokens reach, where that
    boundary is not before the step's first token; here that is the running block's first
    bias + 1 saved tokens folded into it, where the row verified (it has drafts: its inputs are
    saved), else its state as it is (a prefill row, whose state is whole). A copy of a block
    onto itself with nothing to fold is skipped, as vLLM skips it."""
    running = num_computed + num_scheduled - num_draft
    new_computed = running + num_accepted - 1
    aligned = torch.div(new_computed, block_size, rounding_mode="floor") * block_size
    reached = aligned >= running
    dest_column = torch.div(aligned, block_size, rounding_mode="floor") - 1
    counts = torch.where(num_draft > 0, aligned - running + 1, 0)
    in_place = dest_column == state_idx
    acts = reached & ~(in_place & (counts == 0))
    rows = torch.arange(block_table.shape[0], device=block_table.device)
    last = block_table.shape[1] - 1
    sources = block_table[rows, state_idx.clamp(0, last).long()]
    dests = block_table[rows, dest_column.clamp(0, last).long()]
    int32 = torch.int32
    return AlignFolds(
        sources=torch.where(acts, sources, 0).to(int32),
        dests=torch.where(acts, dests, 0).to(int32),
        counts=torch.where(acts, counts, 0).to(int32),
        clears=reached & in_place,
    )

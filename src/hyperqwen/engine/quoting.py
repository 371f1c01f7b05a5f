"""Quoting: a verify block as long as the context's match, MTP's own drafts otherwise.

The design, its costs and what is not hooked into vLLM yet: quoting.md beside this file. Two
halves, one per side of vLLM's engine core:

- on the GPU, each drafting step (`propose`): the fused copy/MTP drafts of every request, padded
  to the widest block, and how many of them each request proposes (`proposed_counts`): the
  match width for a long match, MTP's k otherwise. Tensor ops and one search launch, shapes fixed
  by the batch, no host sync.
- on the host, in the scheduler (`Widths`): the per-request number of draft placeholders the next
  step is scheduled with, from the counts the step outputs carried back.

Which drafts are proposed changes how many are accepted, never what is output: the verify step
and its rejection sampler are vLLM's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hyperqwen.engine.lookup import FUSED_MATCH, LONG_MATCH
from hyperqwen.kernels.lookup import MAX_MATCH, find_suffix_match, fuse_with_mtp

# DRAFT_TOKENS for matches unless set: the longest block the search proposes (a match's
# continuation can run that far) and the settings knob allows.
MATCH_DRAFTS = MAX_MATCH


def proposed_counts(
    match_length: torch.Tensor, mtp_drafts: int, match_drafts: int, room: torch.Tensor | None
) -> torch.Tensor:
    """[B] int32: drafts each request proposes for its next verify: match_drafts where its match
    is LONG_MATCH tokens or more, mtp_drafts otherwise, at most its room (tokens left before
    max_model_len, less the one the step samples) and never below zero."""
    counts = torch.where(match_length >= LONG_MATCH, match_drafts, mtp_drafts).to(torch.int32)
    if room is not None:
        counts = torch.minimum(counts, room.to(torch.int32)).clamp(min=0)
    return counts


def propose(
    mtp_drafts: torch.Tensor,
    tokens: torch.Tensor,
    lengths: torch.Tensor,
    match_drafts: int = MATCH_DRAFTS,
    room: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafts [B, match_drafts] (int32) and counts [B] (int32) for a batch whose MTP drafted
    mtp_drafts [B, k] and whose token buffer rows (tokens [B, width], lengths [B]) end with the
    tokens accepted this step. A row copies the context where its match is long, or short and
    its first copied token is MTP's first draft; it keeps MTP's drafts otherwise; past what it
    proposes, its last draft repeats (valid ids that the scheduler's placeholders may still
    verify for a step, quoting.md: "A match ends")."""
    mtp_count = mtp_drafts.shape[1]
    if not 1 <= mtp_count <= match_drafts <= MAX_MATCH:
        raise ValueError(
            f"need 1 <= MTP's drafts ({mtp_count}) <= match drafts ({match_drafts}) <= {MAX_MATCH}"
        )
    match = find_suffix_match(tokens, lengths, *FUSED_MATCH, match_drafts)
    drafts, _ = fuse_with_mtp(mtp_drafts.to(torch.int32), match, LONG_MATCH)
    return drafts, proposed_counts(match.length, mtp_count, match_drafts, room)


class Widths:
    """The scheduler's side: how many draft placeholders each request's next step gets.

    vLLM's AsyncScheduler gives every decoding request one shared read-only list of -1s per
    step; this keeps one such list per width and hands out the one each request's last reported
    count asks for, MTP's k for a request with no report yet (a first decode, a resumed one)."""

    def __init__(self, mtp_drafts: int, match_drafts: int = MATCH_DRAFTS):
        if not 1 <= mtp_drafts <= match_drafts <= MAX_MATCH:
            raise ValueError(
                f"need 1 <= MTP's drafts ({mtp_drafts}) <= match drafts ({match_drafts}) <= "
                f"{MAX_MATCH}"
            )
        self.mtp_drafts = mtp_drafts
        self.match_drafts = match_drafts
        self._lists = [[-1] * width for width in range(match_drafts + 1)]
        self._counts: dict[str, int] = {}

    def record(self, req_ids: Sequence[str], counts: Sequence[int]) -> None:
        """The counts one step's drafting proposed, in its batch order (the output's req_ids)."""
        if len(req_ids) != len(counts):
            raise ValueError(f"{len(req_ids)} request ids but {len(counts)} draft counts")
        for req_id, count in zip(req_ids, counts, strict=True):
            if not 0 <= count <= self.match_drafts:
                raise ValueError(
                    f"request {req_id!r}: {count} drafts proposed, expected 0..{self.match_drafts}"
                )
            self._counts[req_id] = count

    def placeholders(self, req_id: str) -> list[int]:
        """Its next step's placeholder drafts (a shared list: read it, never change it)."""
        return self._lists[self._counts.get(req_id, self.mtp_drafts)]

    def forget(self, req_id: str) -> None:
        """A finished or preempted request: its next decode starts at MTP's k again."""
        self._counts.pop(req_id, None)

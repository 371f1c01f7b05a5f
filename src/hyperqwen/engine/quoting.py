"""Quoting: a verify block as long as the context's match, MTP's own drafts otherwise.

On when lookup is fused with MTP (LOOKUP=auto or 1, greedy drafts) and vLLM's
num_speculative_tokens (DRAFT_TOKENS) exceeds MTP_DRAFTS: that number is then the widest block
a copy fills, while MTP still drafts MTP_DRAFTS. The design, its costs and what only a GPU run
settles: quoting.md beside this file. vLLM's V1 runner reaches it through its seams
(seams.py; lookup.py's runner_* functions hand them on):

- `attach`, once: full CUDA graphs stay those of a 1 + MTP_DRAFTS-token verify, so a step
  without a match runs the graphs it ran before.
- `drafts`, each drafting step, on the GPU: the fused copy/MTP drafts of every request, padded to
  the widest block, and how many each proposes (`propose`); the counts go to pinned host memory
  on a side stream (`ProposedCounts`), never waited for.
- `trim`, each step's input preparation: each request's scheduled drafts are cut to the count
  its drafting proposed one step earlier (the newest that has surely reached the host), MTP's
  k where none has; the scheduler scheduled the widest block for everyone, and vLLM's own
  correction counts what was cut as rejected, as it does for its GPU n-gram drafter.

Which drafts are verified changes how many are accepted, never what is output: the verify step
and its rejection sampler are vLLM's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from hyperqwen.engine import lookup, lookup_gpu
from hyperqwen.engine.features import MTP_DRAFTS
from hyperqwen.kernels.lookup import MAX_MATCH, find_suffix_match, fuse_with_mtp


def widening(speculative_config: Any) -> bool:
    """Whether quoting widens the block: lookup fused with MTP, and more verify slots than MTP's."""
    return (
        speculative_config is not None
        and lookup.runner_keeps_ngram_buffer(speculative_config)
        and speculative_config.num_speculative_tokens > MTP_DRAFTS
    )


def proposed_counts(match_length: torch.Tensor, mtp_drafts: int, match_drafts: int) -> torch.Tensor:
    """[B] int32: match_drafts where the match is LONG_MATCH tokens or more, else mtp_drafts."""
    long = match_length >= lookup.LONG_MATCH
    return torch.where(long, match_drafts, mtp_drafts).to(torch.int32)


def propose(
    mtp_drafts: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor, match_drafts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafts [B, match_drafts] (int32) and counts [B] (int32) for a batch whose MTP drafted
    mtp_drafts [B, k] and whose token buffer rows (tokens [B, width], lengths [B]) end with the
    tokens accepted this step. A row copies the context where its match is long, or short and
    its first copied token is MTP's first draft; it keeps MTP's drafts otherwise; past what it
    proposes its last draft repeats (valid ids a step may still verify, quoting.md)."""
    mtp_count = mtp_drafts.shape[1]
    if not 1 <= mtp_count <= match_drafts <= MAX_MATCH:
        raise ValueError(
            f"need 1 <= MTP's drafts ({mtp_count}) <= match drafts ({match_drafts}) <= {MAX_MATCH}"
        )
    match = find_suffix_match(tokens, lengths, *lookup.FUSED_MATCH, match_drafts)
    drafts, _ = fuse_with_mtp(mtp_drafts.to(torch.int32), match, lookup.LONG_MATCH)
    return drafts, proposed_counts(match.length, mtp_count, match_drafts)


class ProposedCounts:
    """Each drafting step's counts, by request id, readable on the host one step later.

    Two pinned slots alternate: a step's counts are copied into one on a side stream (after the
    drafting that made them, in stream order) while the other still holds the step before's.
    `previous` reads that older slot, whose copy finished before the engine core scheduled the
    step now being prepared (it waited for that step's outputs), and checks its event without
    waiting: an unfinished copy reads as unknown, never as a stall."""

    def __init__(self, max_reqs: int, device: torch.device | str):
        on_gpu = torch.device(device).type == "cuda"
        self._slots = [
            torch.zeros(max_reqs, dtype=torch.int32, pin_memory=on_gpu) for _ in range(2)
        ]
        self._events = [torch.cuda.Event() if on_gpu else None for _ in range(2)]
        self._stream = torch.cuda.Stream() if on_gpu else None
        self._req_ids: list[list[str]] = [[], []]
        self._newest = 1  # slot 0 is written first

    def publish(self, counts: torch.Tensor, req_ids: Sequence[str]) -> None:
        """This step's counts, row i for req_ids[i] (the batch order it drafted in)."""
        slot = 1 - self._newest
        rows = counts.shape[0]
        if self._stream is None:
            self._slots[slot][:rows].copy_(counts)
        else:
            self._stream.wait_stream(torch.cuda.current_stream())
            # the allocator must not hand counts' memory to the main stream before the copy ran
            counts.record_stream(self._stream)
            with torch.cuda.stream(self._stream):
                self._slots[slot][:rows].copy_(counts, non_blocking=True)
                self._events[slot].record()
        self._req_ids[slot] = list(req_ids[:rows])
        self._newest = slot

    def previous(self) -> dict[str, int]:
        """The counts published before the newest, by request id; {} if that copy is not done."""
        slot = 1 - self._newest
        event = self._events[slot]
        if event is not None and not event.query():
            return {}
        counts = self._slots[slot][: len(self._req_ids[slot])].tolist()
        return dict(zip(self._req_ids[slot], counts, strict=True))


def trim_to_proposed(
    scheduler_output: Any, proposed: Mapping[str, int], mtp_drafts: int = MTP_DRAFTS
) -> dict[str, int]:
    """Cut each request's scheduled drafts to its proposed count (MTP's k where it has none),
    with the step's token counts; return the counts as scheduled, which vLLM's runner keeps as
    the request's draft length for its rejection correction (as for its n-gram drafter)."""
    scheduled = scheduler_output.scheduled_spec_decode_tokens
    original = {}
    for req_id, drafts in list(scheduled.items()):
        original[req_id] = len(drafts)
        keep = max(0, min(len(drafts), proposed.get(req_id, mtp_drafts)))
        cut = len(drafts) - keep
        if cut == 0:
            continue
        scheduler_output.num_scheduled_tokens[req_id] -= cut
        scheduler_output.total_num_scheduled_tokens -= cut
        if keep:
            scheduled[req_id] = drafts[:keep]
        else:
            del scheduled[req_id]
    return original


# The runner's hooks (with lookup on: seams.py calls none otherwise). Each is inert (lookup's
# fused path, vLLM's block) unless `widening`.


def attach(runner: Any) -> None:
    """After the runner built its CUDA graph dispatcher: full graphs for 1 + MTP_DRAFTS-token
    verify batches (a block with a copy runs a piecewise graph), and the counts' host slots; on
    SPEC=lookup's GPU path, lookup_gpu.attach."""
    runner.hq_proposed = None
    runner.hq_no_count = MTP_DRAFTS
    if lookup_gpu.applies(runner.speculative_config):
        lookup_gpu.attach(runner)
        return
    if not widening(runner.speculative_config):
        return
    runner.uniform_decode_query_len = 1 + MTP_DRAFTS
    runner.cudagraph_dispatcher.uniform_decode_query_len = 1 + MTP_DRAFTS
    runner.hq_proposed = ProposedCounts(runner.max_num_reqs, runner.device)


def trims(runner: Any) -> bool:
    """Whether the runner cuts scheduled drafts (and so works on its own copy of the scheduler's
    output, as vLLM's runner does for its GPU n-gram drafter)."""
    return runner.hq_proposed is not None


def mtp_drafts(runner: Any, scheduled: int) -> int:
    """How many drafts MTP makes this step: MTP_DRAFTS when quoting widens, else vLLM's."""
    return MTP_DRAFTS if trims(runner) else scheduled


def drafts(runner: Any, mtp_drafted: torch.Tensor, sampled_token_ids: torch.Tensor) -> torch.Tensor:
    """After MTP drafted: the accepted tokens into the token buffer, then the fused drafts, as
    wide as the block when quoting widens (publishing each request's count), else MTP's."""
    buffer, counts = runner.token_ids_gpu_tensor, runner.num_tokens_no_spec_gpu
    mask, vocab = runner.discard_request_mask.gpu, runner.input_batch.vocab_size
    lengths = lookup.write_accepted(sampled_token_ids, mask, buffer, counts, vocab)
    if not trims(runner):
        return lookup.fuse_into_mtp(mtp_drafted, buffer, lengths)
    rows = mtp_drafted.shape[0]
    width = runner.speculative_config.num_speculative_tokens
    fused, proposed = propose(mtp_drafted, buffer[:rows], lengths, width)
    runner.hq_proposed.publish(proposed, runner.input_batch.req_ids)
    return fused.to(mtp_drafted.dtype)


def trim(runner: Any, scheduler_output: Any) -> dict[str, int]:
    """Before the step's inputs are prepared: `trim_to_proposed` with the newest counts on the
    host (for a request without one, MTP's k, or 0 on SPEC=lookup's GPU path); {} (nothing cut)
    unless quoting widens or lookup drafts on the GPU."""
    if not trims(runner):
        return {}
    return trim_to_proposed(scheduler_output, runner.hq_proposed.previous(), runner.hq_no_count)

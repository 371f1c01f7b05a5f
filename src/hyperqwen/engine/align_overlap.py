"""Prefix caching on a hybrid model without a per-step wait for the previous step's counts.

With prefix caching, vLLM 0.26 keeps Gated DeltaNet state per cache block ("align" mode). Before
each step its V1 runner then blocks until the previous step's accepted-token counts reach the
CPU, because preprocess_mamba must know which block a request's state ends in; the rest of the
step's preparation then runs while the GPU waits, where without prefix caching it overlaps the
previous step. That wait is needed only when a request can reach a new block this step: blocks
hold hundreds of tokens, a decode step moves at most 1 + drafts.

With HYPERQWEN_ALIGN_OVERLAP=1 (the V1 runner's seams in seams.py), a step where no request's
block can change whatever the previous step accepted (step_is_safe) skips the wait: the accepted
counts come from the previous step's postprocess output on the GPU (runner_counts_on_gpu),
the count corrections run after the launch as without prefix caching, and the inputs of the
step's own postprocess kernel, which need the corrected counts, are staged after them (still
before that kernel, in stream order). Any other step runs vLLM's own path.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("vllm.hyperqwen.align_overlap")
_announced = False


def block_index(num_tokens: int, block_size: int) -> int:
    """The block that holds token num_tokens - 1 (as preprocess_mamba: cdiv(n, size) - 1)."""
    return (num_tokens - 1) // block_size


def step_is_safe(
    requests: dict,
    req_ids: list[str],
    num_scheduled: dict[str, int],
    state_block: dict[str, int],
    finished_or_restarted: set[str],
    block_size: int,
    max_drafts: int,
) -> bool:
    """Whether every request's running-state block stays where it is for every count the
    previous step may have accepted: its optimistic num_computed_tokens (all drafts accepted)
    and that less max_drafts give the block it is in. A request without a block yet (new or
    resumed) makes the step unsafe: preprocess_mamba may copy its cached state with an offset
    read from the CPU copy of the accepted counts, which only vLLM's waiting path settles."""
    for req_id in req_ids:
        previous = state_block.get(req_id)
        if previous is None or req_id in finished_or_restarted:
            return False
        optimistic = requests[req_id].num_computed_tokens + num_scheduled[req_id]
        lowest = optimistic - max_drafts
        if lowest < 1 or {block_index(optimistic, block_size), block_index(lowest, block_size)} != {
            previous
        }:
            return False
    return True


def runner_step_begins(runner, scheduler_output) -> bool:
    """Whether this step of vLLM's GPU model runner skips the wait."""
    if runner.cache_config.mamba_cache_mode != "align":
        return False
    if not runner.use_async_scheduling or runner.speculative_config is None:
        return False
    if runner._get_mamba_bufs().postprocess_align is None:
        return False
    from vllm.v1.worker.mamba_utils import get_mamba_groups

    _, mamba_spec = get_mamba_groups(runner.kv_cache_config)
    cached = scheduler_output.scheduled_cached_reqs
    restarted = {
        *scheduler_output.finished_req_ids,
        *(scheduler_output.preempted_req_ids or ()),
        *cached.resumed_req_ids,
    }
    safe = step_is_safe(
        runner.requests,
        runner.input_batch.req_ids,
        scheduler_output.num_scheduled_tokens,
        runner.mamba_state_idx,
        restarted,
        mamba_spec.block_size,
        runner.speculative_config.num_speculative_tokens,
    )
    global _announced
    if safe and not _announced:
        _announced = True
        log.info("align overlap: a step prepared without waiting (blocks of %d tokens)",
                 mamba_spec.block_size)  # fmt: skip
    return safe


def runner_counts_on_gpu(runner, num_reqs: int) -> None:
    """The accepted counts of a step that skipped the wait, from the previous postprocess."""
    take_postprocess_counts(
        runner.num_accepted_tokens.gpu,
        runner._get_mamba_bufs().postprocess_align.num_accepted_tokens_out,
        runner.prev_positions.gpu[:num_reqs],
    )


def take_postprocess_counts(
    num_accepted: torch.Tensor, postprocess_out: torch.Tensor, prev_positions: torch.Tensor
) -> None:
    """num_accepted[i] = the previous step's postprocess count of the request now in row i (as
    vLLM's waiting path reads it back from the CPU); rows new to the batch keep theirs (1)."""
    rows = prev_positions.shape[0]
    gathered = postprocess_out[prev_positions.clamp(min=0).long()]
    num_accepted[:rows].copy_(torch.where(prev_positions >= 0, gathered, num_accepted[:rows]))

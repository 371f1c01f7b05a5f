"""Lookup drafting: drafts copied from the request's own context.

Three uses, switched by HYPERQWEN_LOOKUP (the launcher sets it from the LOOKUP knob, and from
LOOKUP_DEVICE for SPEC=lookup):

- SPEC=lookup (the variable is 1): vLLM 0.26's CPU `ngram` proposer asks `propose` here for each
  request (the ngram_drafts seam, seams.py) instead of its own search: the longest, then most
  recent earlier occurrence of the context's last 2-12 tokens (kernels/lookup.py,
  `suffix_match_on_host`), whose continuation is what the text did last time, extended
  periodically when it runs into the present, and as many drafts as the match supports. vLLM's
  `ngram_gpu` path was the first home of this: on the H200 (SmolLM2-135M, 2026-12-01) it drafted
  at 0.47-0.49x the tokens/s of vLLM's CPU `ngram` on copy and chat prompts at C1 (0.22 against
  0.88 first-draft acceptance while copying), the async-scheduling loss vllm-project/vllm#37150
  reports for that path. With LOOKUP_FILL=1 (the variable is fill) a step without a match
  proposes all the same (what followed the last token's latest earlier occurrence, else that
  token repeated), so every decode step verifies one width: vLLM's uniform-decode batch, which
  it replays as a full CUDA graph under FULL_AND_PIECEWISE, where a step of 1 token runs the
  piecewise graph.
- SPEC=lookup LOOKUP_DEVICE=gpu (the variable is gpu): vLLM's `ngram_gpu` runner path, async
  scheduling on, with this search and policy on the GPU and quoting's one-step-late cut instead
  of vLLM's waiting one (lookup_gpu.py, quoting.md's "Lookup alone": lossless on the H100,
  slower than the CPU path on SmolLM2).
- SPEC=mtp with LOOKUP=auto or 1 (`runner_keeps_ngram_buffer`): the V1 runner keeps the GPU token
  buffer of vLLM's `ngram_gpu` path for MTP (the V1 runner's seams; its upkeep under async
  scheduling is the path above, so its acceptance is to be measured before it is recommended)
  and, after MTP has drafted (runner_drafted), `write_accepted` writes the new tokens into it and
  `fuse_into_mtp` puts a copy in MTP's draft slots where the match is long (LONG_MATCH tokens)
  or where MTP's first draft agrees with it. Only with greedy drafts: a copied draft is a point
  mass, and MTP's draft probabilities would no longer describe it. With more draft slots than
  MTP's, quoting.py widens the verify block where the match is long (the other runner seams
  below hand it on).

Verification is vLLM's, so the output is the model's either way; only which drafts are proposed
(and so how many are accepted) changes.
"""

from __future__ import annotations

import numpy as np
import torch

from hyperqwen.engine.features import LOOKUP, LOOKUP_FILLED, ON, env_value
from hyperqwen.kernels.lookup import find_suffix_match, fuse_with_mtp, suffix_match_on_host

# Fused with MTP: matches of 2-12 tokens are found; one of LONG_MATCH or more is copied alone,
# a shorter one only where MTP's first draft agrees with it.
FUSED_MATCH = (2, 12)
LONG_MATCH = 6


def propose(
    context: np.ndarray,
    min_n: int,
    max_n: int,
    num_drafts: int,
    max_model_len: int,
    fill: bool = False,
) -> list[int]:
    """One request's drafts from its tokens so far (prompt and accepted output): what followed
    the longest, latest earlier match of its last min_n..max_n tokens, num_drafts of them
    whatever the match's length (a cap on short matches lost speed: quoting.md, "Lookup's
    match"); no match proposes nothing, or with fill (LOOKUP_FILL) num_drafts all the same:
    what followed the last token's latest earlier occurrence, else that token repeated, so
    every step verifies one width. Never past max_model_len."""
    length = int(context.shape[0])
    n, start = suffix_match_on_host(context, min_n, max_n)
    if not n and fill and length:
        n, start = suffix_match_on_host(context, 1, 1)
        if not n:  # the last token occurred nowhere before: it, repeated
            n, start = 1, length - 1
    count = min(num_drafts, max_model_len - length) if n else 0
    if count <= 0:
        return []
    return context[start + np.arange(count) % (length - start)].tolist()


def ngram_drafts(
    proposer, num_requests: int, valid_ngram_requests: list, num_tokens_no_spec, token_ids_cpu, k
) -> list[list[int]] | None:
    """vLLM's CPU n-gram proposer's drafts (batch_propose's arguments): `propose`'s for each
    valid request, none for the others. Only at 1 or fill, which the launcher sets for
    SPEC=lookup (fill with LOOKUP_FILL=1): auto leaves vLLM's own n-gram search alone (None)."""
    value = env_value(LOOKUP)
    if value not in (ON, LOOKUP_FILLED):
        return None
    valid = set(valid_ngram_requests)
    return [
        propose(token_ids_cpu[i, : num_tokens_no_spec[i]], proposer.min_n, proposer.max_n, k,
                proposer.max_model_len, fill=value == LOOKUP_FILLED)
        if i in valid
        else []
        for i in range(num_requests)
    ]  # fmt: skip


def runner_keeps_ngram_buffer(speculative_config) -> bool:
    """Lookup drafts go into MTP's draft slots: greedy MTP drafts only (so LOOKUP=auto is
    decided here, where the drafter's method and sampling are known)."""
    return speculative_config.method == "mtp" and speculative_config.draft_sample_method == "greedy"


def allocate_token_buffer(runner) -> None:
    """The per-request GPU token buffer and counts vLLM's runner keeps for `ngram_gpu`, for MTP:
    the runner's n-gram bookkeeping (new requests, reorders, count corrections) then keeps them."""
    device = runner.device
    runner.num_tokens_no_spec_gpu = torch.zeros(
        runner.max_num_reqs, dtype=torch.int32, device=device
    )
    runner.token_ids_gpu_tensor = torch.zeros(
        runner.max_num_reqs, runner.max_model_len, dtype=torch.int32, device=device
    )
    runner._ngram_pinned_idx_buf = torch.zeros(
        runner.max_num_reqs, dtype=torch.long, pin_memory=True
    )
    runner._ngram_pinned_val_buf = torch.zeros(
        runner.max_num_reqs, dtype=torch.int32, pin_memory=True
    )


def runner_drafter_built(runner) -> None:
    if runner_keeps_ngram_buffer(runner.speculative_config):
        allocate_token_buffer(runner)


# The V1 runner's seams for quoting: quoting.py decides.


def _quoting():
    from hyperqwen.engine import quoting  # imported here: quoting.py builds on this module

    return quoting


def runner_graphs_dispatched(runner) -> None:
    _quoting().attach(runner)


def runner_copies_scheduler_output(runner) -> bool:
    return _quoting().trims(runner)


def runner_cut_drafts(runner, scheduler_output) -> dict[str, int]:
    return _quoting().trim(runner, scheduler_output)


def runner_draft_count(runner, scheduled: int) -> int:
    return _quoting().mtp_drafts(runner, scheduled)


def runner_drafted(runner, draft_token_ids, sampled_token_ids):
    """MTP's drafts with copies from the context, where fused with MTP (quoting.drafts: as wide
    as the block where quoting widens it, else `fuse_into_mtp`)."""
    if not runner_keeps_ngram_buffer(runner.speculative_config) or not isinstance(
        sampled_token_ids, torch.Tensor
    ):
        return draft_token_ids
    return _quoting().drafts(runner, draft_token_ids, sampled_token_ids)


def write_accepted(
    sampled_token_ids: torch.Tensor,
    discard_mask: torch.Tensor,
    token_ids: torch.Tensor,
    num_tokens: torch.Tensor,
    vocab_size: int,
) -> torch.Tensor:
    """Write this step's accepted tokens (sampled_token_ids [B, k+1], -1 where rejected) into the
    token buffer after each row's num_tokens, as vLLM's n-gram proposer does; return each row's
    length with them ([B] int32)."""
    rows, width = sampled_token_ids.shape[0], token_ids.shape[1]
    sampled = sampled_token_ids.masked_fill(discard_mask[:rows, None], -1)
    valid = (sampled != -1) & (sampled < vocab_size)
    count = valid.sum(dim=1, dtype=torch.int32)
    offsets = torch.arange(sampled.shape[1], device=sampled.device)
    positions = num_tokens[:rows, None] + offsets[None, :]
    write = (offsets[None, :] < count[:, None]) & valid & (positions < width)
    positions = positions.clamp(max=width - 1).long()
    buffer = token_ids[:rows]
    buffer.scatter_(
        1, positions, torch.where(write, sampled.to(buffer.dtype), buffer.gather(1, positions))
    )
    return (num_tokens[:rows] + count).to(torch.int32)


def fuse_into_mtp(
    mtp_drafts: torch.Tensor, token_ids: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    """MTP's drafts [B, k] with a copy from the context where it wins (fuse_with_mtp); the
    context is each row of the token buffer up to its length from `write_accepted`."""
    rows = mtp_drafts.shape[0]
    match = find_suffix_match(token_ids[:rows], lengths, *FUSED_MATCH, mtp_drafts.shape[1])
    drafts, _ = fuse_with_mtp(mtp_drafts.to(torch.int32), match, LONG_MATCH)
    return drafts[:, : mtp_drafts.shape[1]].to(mtp_drafts.dtype)

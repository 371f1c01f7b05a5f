"""Lookup drafting: drafts copied from the request's own context, found on the GPU.

Two uses, both switched on by HYPERQWEN_LOOKUP=1 (the launcher sets it):

- SPEC=lookup: vLLM 0.26's `ngram_gpu` method keeps every request's tokens in a GPU buffer and,
  each step, proposes the tokens that followed the *earliest* earlier occurrence of the
  context's suffix. Its proposer asks `propose` here instead (patches/lookup-search.patch): the
  longest, then most recent occurrence (kernels/lookup.py), whose continuation is what the text
  did last time, extended periodically when it runs into the present.
- SPEC=mtp with LOOKUP=1 (`fused`): the V1 runner keeps the same token buffer for MTP
  (patches/lookup-mtp.patch) and, after MTP has drafted, `fuse_into_mtp` writes the new tokens
  into it and puts a copy in MTP's draft slots where the match is long (LONG_MATCH tokens) or
  where MTP's first draft agrees with it. Only with greedy drafts: a copied draft is a point
  mass, and MTP's draft probabilities would no longer describe it.

Verification is vLLM's, so the output is the model's either way; only which drafts are proposed
(and so how many are accepted) changes.
"""

from __future__ import annotations

import os

import torch

from hyperqwen.engine import LOOKUP_ENV
from hyperqwen.kernels.lookup import find_suffix_match, fuse_with_mtp

# Fused with MTP: matches of 2-12 tokens are found; one of LONG_MATCH or more is copied alone,
# a shorter one only where MTP's first draft agrees with it.
FUSED_MATCH = (2, 12)
LONG_MATCH = 6
# SPEC=lookup: drafts a match shorter than LONG_MATCH may propose (the default DRAFT_TOKENS)
SHORT_MATCH_DRAFTS = 4


def enabled() -> bool:
    return os.environ.get(LOOKUP_ENV) == "1"


def propose(
    num_tokens: torch.Tensor,
    token_ids: torch.Tensor,
    valid_rows: torch.Tensor,
    min_n: int,
    max_n: int,
    num_drafts: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's n-gram kernel contract: ([B, num_drafts] int32 drafts, -1 where a row proposes
    nothing; [B] int32 count of leading valid drafts). Rows not in valid_rows propose nothing.
    A match of LONG_MATCH tokens or more proposes all num_drafts; a shorter one (more often
    chance) at most SHORT_MATCH_DRAFTS, so a long verify block (DRAFT_TOKENS=15) is spent only
    where the answer is copying: vLLM's GPU n-gram path verifies only the valid drafts."""
    match = find_suffix_match(token_ids, num_tokens.to(torch.int32), min_n, max_n, num_drafts)
    proposes = valid_rows & (match.length > 0)
    short = min(num_drafts, SHORT_MATCH_DRAFTS)
    counts = torch.where(match.length >= LONG_MATCH, num_drafts, short)
    counts = torch.where(proposes, counts, 0).to(torch.int32)
    offsets = torch.arange(num_drafts, device=counts.device)[None, :]
    drafts = torch.where(offsets < counts[:, None], match.drafts, -1)
    return drafts, counts


def fused(speculative_config) -> bool:
    """Lookup drafts go into MTP's draft slots (greedy MTP drafts only)."""
    return (
        enabled()
        and speculative_config.method == "mtp"
        and speculative_config.draft_sample_method == "greedy"
    )


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


def fuse_into_mtp(
    mtp_drafts: torch.Tensor,
    sampled_token_ids: torch.Tensor,
    discard_mask: torch.Tensor,
    token_ids: torch.Tensor,
    num_tokens: torch.Tensor,
    vocab_size: int,
) -> torch.Tensor:
    """Write this step's accepted tokens (sampled_token_ids [B, k+1], -1 where rejected) into the
    token buffer after each row's num_tokens, as vLLM's n-gram proposer does, then return MTP's
    drafts [B, k] with a copy from the context where it wins (fuse_with_mtp)."""
    rows, width = mtp_drafts.shape[0], token_ids.shape[1]
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
    match = find_suffix_match(
        buffer, (num_tokens[:rows] + count).to(torch.int32), *FUSED_MATCH, mtp_drafts.shape[1]
    )
    drafts, _ = fuse_with_mtp(mtp_drafts.to(torch.int32), match, LONG_MATCH)
    return drafts[:, : mtp_drafts.shape[1]].to(mtp_drafts.dtype)

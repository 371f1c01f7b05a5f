"""Lookup drafting inside vLLM's GPU n-gram proposer (SPEC=lookup).

vLLM 0.26's `ngram_gpu` method keeps every request's tokens in a GPU buffer and, each step,
proposes the tokens that followed the *earliest* earlier occurrence of the context's suffix.
With HYPERQWEN_LOOKUP=1 (patches/lookup-search.patch) its proposer asks this module instead: the
longest, then most recent occurrence (kernels/lookup.py), whose continuation is what the text did
last time, extended periodically when it runs into the present. Verification is vLLM's, so the
output is the model's either way; only which drafts are proposed changes.
"""

from __future__ import annotations

import os

import torch

from hyperqwen.engine import LOOKUP_ENV
from hyperqwen.kernels.lookup import find_suffix_match


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
    nothing; [B] int32 count of leading valid drafts). Rows not in valid_rows propose nothing."""
    match = find_suffix_match(token_ids, num_tokens.to(torch.int32), min_n, max_n, num_drafts)
    proposes = valid_rows & (match.length > 0)
    drafts = torch.where(proposes[:, None], match.drafts, -1)
    return drafts, torch.where(proposes, num_drafts, 0).to(torch.int32)

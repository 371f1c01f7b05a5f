"""Lookup drafting's search: the longest, most recent earlier occurrence of a context's suffix.

Status: correct (tests/test_kernel_lookup.py, Triton's interpreter against a Python reference;
passed compiled on the H200). An engine feature calls it (engine/README.md's feature table);
`suffix_match_on_host` is the same search on one request's tokens in host memory. Not timed.

For each row b of `tokens` ([B, W] int32, the first lengths[b] valid: prompt and generated
tokens), a candidate is a position j (1 <= j < length) whose preceding tokens equal the
context's last ones: tokens[j - k] == tokens[length - k] for k = 1..n. The row's match is the
candidate with the largest n (capped at max_n), the latest j among equals, and n >= min_n; the
tokens from j on are what the context did after that suffix last time, proposed as drafts. A
match may overlap the suffix (periodic text: "abab" proposes "abab...").

One program scans BLOCK candidates of one row, comparing up to max_n tokens back, and folds its
best (n, j) into one int32 per row with an atomic max of n * 2**26 + j: longest first, then
latest, whatever order programs finish in, so the result is deterministic. Programs past a row's
length return at once, so a launch over the buffer's whole width (a fixed grid, as CUDA-graph
capture needs) costs what the context holds.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl

POSITION_BITS = 26  # j < 2**26 tokens; n <= 15 keeps n * 2**26 + j within int32
MAX_MATCH = 15
BLOCK = 1024


@triton.jit
def _suffix_match_kernel(
    tokens_ptr,
    stride_row,
    lengths_ptr,
    best_ptr,
    MIN_N: tl.constexpr,
    MAX_N: tl.constexpr,
    POSITION_BITS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    start = tl.program_id(1) * BLOCK
    length = tl.load(lengths_ptr + row)
    if start >= length:
        return
    base = tokens_ptr + row.to(tl.int64) * stride_row
    j = start + tl.arange(0, BLOCK)
    alive = (j >= 1) & (j < length)  # j == length would be the suffix itself
    n = tl.zeros([BLOCK], dtype=tl.int32)
    for k in tl.static_range(1, MAX_N + 1):
        earlier = tl.load(base + (j - k), mask=alive & (j >= k), other=-1)
        suffix = tl.load(base + (length - k), mask=length >= k, other=-2)
        alive = alive & (j >= k) & (length >= k) & (earlier == suffix)
        n += alive.to(tl.int32)
    key = tl.where(n >= MIN_N, (n << POSITION_BITS) + j, 0)
    tl.atomic_max(best_ptr + row, tl.max(key, axis=0))


class SuffixMatch(NamedTuple):
    length: torch.Tensor  # [B] int32: tokens matched, 0 where the row has no match
    drafts: torch.Tensor  # [B, num_drafts] int32: what followed the match (see below)


def find_suffix_match(
    tokens: torch.Tensor,
    lengths: torch.Tensor,
    min_n: int,
    max_n: int,
    num_drafts: int,
) -> SuffixMatch:
    """Each row's longest, latest earlier occurrence of its last min_n..max_n tokens, and the
    num_drafts tokens that followed it. A continuation that reaches the context's end goes on
    as the copy itself would (position j + i mod (length - j): the text repeats with that
    period). A row without a match gets its last token repeated: every draft is a valid id."""
    if tokens.dim() != 2 or tokens.dtype != torch.int32 or tokens.stride(1) != 1:
        raise ValueError("tokens: a [B, W] int32 tensor with contiguous rows")
    if lengths.shape != (tokens.shape[0],) or lengths.dtype != torch.int32:
        raise ValueError("lengths: [B] int32, one per row of tokens")
    if not 1 <= min_n <= max_n <= MAX_MATCH:
        raise ValueError(f"need 1 <= min_n <= max_n <= {MAX_MATCH}, got {min_n}, {max_n}")
    if tokens.shape[1] >= 2**POSITION_BITS:
        raise ValueError(f"rows of at most {2**POSITION_BITS - 1} tokens")
    rows, width = tokens.shape
    best = torch.zeros(rows, dtype=torch.int32, device=tokens.device)
    if rows and width:
        grid = (rows, triton.cdiv(width, BLOCK))
        _suffix_match_kernel[grid](
            tokens, tokens.stride(0), lengths, best, min_n, max_n, POSITION_BITS, BLOCK
        )
    matched = best >> POSITION_BITS
    start = best & ((1 << POSITION_BITS) - 1)
    offsets = torch.arange(num_drafts, device=tokens.device, dtype=torch.int32)[None, :]
    period = (lengths - start).clamp(min=1)[:, None]
    last = (lengths - 1).clamp(min=0)[:, None]
    source = torch.where((matched > 0)[:, None], start[:, None] + offsets % period, last)
    return SuffixMatch(matched, tokens.gather(1, source.long()))


def suffix_match_on_host(context: np.ndarray, min_n: int, max_n: int) -> tuple[int, int]:
    """The same search for one request's tokens in host memory (SPEC=lookup drafts there, in
    vLLM's CPU n-gram proposer): (n, j) of the longest, then latest match, (0, 0) without one
    of at least min_n tokens. One pass over the context compares its last token; each longer n
    only re-checks the candidates still alive, so a step costs about one read of the context."""
    length = int(context.shape[0])
    candidates = np.flatnonzero(context[: length - 1] == context[length - 1]) + 1 if length else []
    best = (0, 0)
    for n in range(1, max_n + 1):
        if n > 1:
            candidates = candidates[candidates >= n]
            candidates = candidates[context[candidates - n] == context[length - n]]
        if len(candidates) == 0:
            break
        if n >= min_n:
            best = (n, int(candidates[-1]))
    return best


def fuse_with_mtp(
    mtp_drafts: torch.Tensor, match: SuffixMatch, long_match: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the drafts to verify: the lookup's where its match is long (>= long_match
    tokens), or shorter and its first token is MTP's first draft; MTP's otherwise. Returns
    ([B, max(k, num_drafts)] drafts, [B] how many are proposals); past MTP's k drafts its rows
    repeat their last one, so every id is a valid token."""
    mtp_count, lookup_count = mtp_drafts.shape[1], match.drafts.shape[1]
    width = max(mtp_count, lookup_count)
    agrees = match.drafts[:, 0] == mtp_drafts[:, 0]
    use_lookup = (match.length > 0) & ((match.length >= long_match) | agrees)
    drafts = torch.where(
        use_lookup[:, None], _pad_repeating(match.drafts, width), _pad_repeating(mtp_drafts, width)
    )
    counts = torch.where(use_lookup, lookup_count, mtp_count).to(torch.int32)
    return drafts, counts


def _pad_repeating(drafts: torch.Tensor, width: int) -> torch.Tensor:
    """[B, width]: each row's drafts, then its last one repeated."""
    columns = torch.arange(width, device=drafts.device).clamp(max=drafts.shape[1] - 1)
    return drafts[:, columns]

"""Lookup drafting's suffix search (kernels/lookup.py) against a plain-Python reference.

On the CPU the Triton kernel runs in Triton's interpreter (conftest); on a GPU the same tests run
it compiled. Rows are random token streams with repeats planted in them (random text over a small
vocabulary repeats short n-grams by chance too), lengths vary per row, widths are not multiples
of the kernel's block, and every output starts as garbage.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from hyperqwen.kernels import lookup

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference_match(context: list[int], min_n: int, max_n: int) -> tuple[int, int]:
    """(n, j) of the longest, then latest, j < len with context[j-k] == context[len-k] for
    k = 1..n (n capped at max_n); (0, 0) without one of at least min_n tokens."""
    length = len(context)
    best = (0, 0)
    for j in range(1, length):
        n = 0
        while n < max_n and j - n - 1 >= 0 and context[j - n - 1] == context[length - n - 1]:
            n += 1
        if n >= min_n and (n, j) > best:
            best = (n, j)
    return best


def reference_drafts(context: list[int], n: int, j: int, count: int) -> list[int]:
    """What followed the match, the copy extending itself past the context's end."""
    if n == 0:
        return [context[-1]] * count
    drafts = context[j:]
    while len(drafts) < count:
        drafts.append(drafts[len(drafts) - (len(context) - j)])
    return drafts[:count]


def planted_rows(seed: int, rows: int, width: int, vocab: int) -> list[list[int]]:
    """Random contexts of varied length, most with an earlier span copied to their end."""
    rng = random.Random(seed)
    contexts = []
    for _ in range(rows):
        length = rng.randint(1, width)
        context = [rng.randrange(vocab) for _ in range(length)]
        if length > 8 and rng.random() < 0.8:
            span = rng.randint(2, min(20, length // 2))
            start = rng.randrange(0, length - 2 * span + 1)
            context[length - span :] = context[start : start + span]
        contexts.append(context)
    return contexts


def as_buffer(contexts: list[list[int]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The [B, width] buffer vLLM keeps (garbage past each length) and the lengths."""
    buffer = torch.randint(0, 50_000, (len(contexts), width), dtype=torch.int32)
    for row, context in enumerate(contexts):
        buffer[row, : len(context)] = torch.tensor(context, dtype=torch.int32)
    lengths = torch.tensor([len(c) for c in contexts], dtype=torch.int32)
    return buffer.to(DEVICE), lengths.to(DEVICE)


@pytest.mark.parametrize(
    ("seed", "rows", "width", "vocab", "min_n", "max_n", "num_drafts"),
    [
        (0, 6, 300, 5, 1, 4, 3),  # tiny vocabulary: short chance matches everywhere
        (1, 5, 1500, 40, 2, 12, 15),  # two blocks wide, the 12-token cap
        (2, 4, 2100, 1000, 6, 15, 8),  # three blocks, long matches only, the widest cap
        (3, 3, 64, 3, 3, 3, 4),  # min_n == max_n: many ties, the latest must win
    ],
)
def test_matches_the_reference(seed, rows, width, vocab, min_n, max_n, num_drafts):
    contexts = planted_rows(seed, rows, width, vocab)
    tokens, lengths = as_buffer(contexts, width)
    match = lookup.find_suffix_match(tokens, lengths, min_n, max_n, num_drafts)
    for row, context in enumerate(contexts):
        n, j = reference_match(context, min_n, max_n)
        assert match.length[row].item() == n, (row, context[-20:])
        assert match.drafts[row].tolist() == reference_drafts(context, n, j, num_drafts)
    assert (match.length > 0).any()


@pytest.mark.parametrize(
    ("seed", "rows", "width", "vocab", "min_n", "max_n"),
    [
        (0, 40, 300, 5, 1, 4),
        (1, 30, 1500, 40, 3, 12),
        (2, 20, 2100, 1000, 6, 15),
        (3, 40, 64, 3, 3, 3),
    ],
)
def test_the_host_search_matches_the_reference(seed, rows, width, vocab, min_n, max_n):
    """suffix_match_on_host (SPEC=lookup's search, on one request's tokens): the same (n, j)."""
    contexts = planted_rows(seed, rows, width, vocab)
    found = [
        lookup.suffix_match_on_host(np.array(c, dtype=np.int32), min_n, max_n) for c in contexts
    ]
    assert found == [reference_match(c, min_n, max_n) for c in contexts]
    assert any(n for n, _ in found)


def test_the_host_search_on_edge_rows():
    cases = {(7, 8) * 6: (10, 10), (1, 2, 3, 9, 1, 2, 3): (3, 3), (5,): (0, 0), (): (0, 0)}
    for context, expected in cases.items():
        assert lookup.suffix_match_on_host(np.array(context, dtype=np.int32), 1, 15) == expected


def test_edge_rows():
    periodic = [7, 8] * 6  # the match overlaps the suffix and the copy continues itself
    near_end = [1, 2, 3, 9, 1, 2, 3]  # "1 2 3" again: "9 1 2 3" and on, period 4
    cases = [periodic, near_end, [5], [4, 4], [1, 2, 3, 4]]
    tokens, lengths = as_buffer(cases, 40)
    match = lookup.find_suffix_match(tokens, lengths, 1, 15, 6)
    assert match.length.tolist() == [10, 3, 0, 1, 0]
    assert match.drafts.tolist() == [
        [7, 8, 7, 8, 7, 8],
        [9, 1, 2, 3, 9, 1],
        [5] * 6,  # one token: nothing earlier to match
        [4] * 6,
        [4] * 6,  # no repeat at all
    ]


def test_bad_arguments_say_what_is_wrong():
    tokens, lengths = as_buffer([[1, 2, 3]], 8)
    with pytest.raises(ValueError, match="int32"):
        lookup.find_suffix_match(tokens.long(), lengths, 1, 4, 2)
    with pytest.raises(ValueError, match="lengths"):
        lookup.find_suffix_match(tokens, lengths[:0], 1, 4, 2)
    with pytest.raises(ValueError, match="max_n"):
        lookup.find_suffix_match(tokens, lengths, 2, 16, 2)


def test_fusion_takes_long_matches_and_agreeing_short_ones():
    mtp = torch.tensor([[1, 2, 3]] * 4, dtype=torch.int32)
    copies = torch.tensor([[9, 9, 9, 9, 5], [1, 7, 7, 7, 7], [6, 6, 6, 6, 6], [1, 4, 4, 4, 4]])
    match = lookup.SuffixMatch(torch.tensor([8, 3, 3, 0], dtype=torch.int32), copies.int())
    drafts, counts = lookup.fuse_with_mtp(mtp, match, long_match=6)
    assert drafts.tolist() == [
        [9, 9, 9, 9, 5],  # long match: the copy
        [1, 7, 7, 7, 7],  # short, and MTP's first draft agrees: the copy
        [1, 2, 3, 3, 3],  # short, MTP disagrees: MTP's, its last draft repeated
        [1, 2, 3, 3, 3],  # no match (its drafts agreeing with MTP do not count)
    ]
    assert counts.tolist() == [5, 5, 3, 3]
    assert counts.dtype == torch.int32

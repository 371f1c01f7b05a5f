"""Quoting's variable verify width (engine/quoting.py) against a per-row Python reference.

`propose` runs on the GPU in the engine; here its search kernel runs in Triton's interpreter
(conftest) and its tensor ops on the CPU. Rows are random contexts with copies planted at their
ends (tests/test_kernel_lookup.py's generator), MTP's drafts random, and each row's room before
max_model_len random, zero included.
"""

from __future__ import annotations

import random

import pytest
import torch
from test_kernel_lookup import planted_rows, reference_drafts, reference_match

from hyperqwen.engine import quoting
from hyperqwen.engine.lookup import FUSED_MATCH, LONG_MATCH

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(context: list[int], mtp: list[int], match_drafts: int, room: int | None):
    """One row's drafts and count, written out: the copy where the match is long, or short and
    agreeing with MTP's first draft; MTP's drafts otherwise; each padded with its last draft.
    The count is the match width for a long match, MTP's k otherwise, capped by the room."""
    n, j = reference_match(context, *FUSED_MATCH)
    copy = reference_drafts(context, n, j, match_drafts)
    if n and (n >= LONG_MATCH or copy[0] == mtp[0]):
        drafts = copy
    else:
        drafts = mtp + [mtp[-1]] * (match_drafts - len(mtp))
    count = match_drafts if n >= LONG_MATCH else len(mtp)
    if room is not None:
        count = max(0, min(count, room))
    return drafts, count


def batch(contexts: list[list[int]], width: int, seed: int):
    """The token buffer as the runner keeps it: garbage past each row's length."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 1 << 20, (len(contexts), width), generator=generator)
    tokens = tokens.to(torch.int32)
    for row, context in enumerate(contexts):
        tokens[row, : len(context)] = torch.tensor(context, dtype=torch.int32)
    lengths = torch.tensor([len(c) for c in contexts], dtype=torch.int32)
    return tokens.to(DEVICE), lengths.to(DEVICE)


@pytest.mark.parametrize(
    ("mtp_count", "match_drafts", "rows", "width", "vocab", "with_room"),
    [
        (3, 15, 16, 300, 7, True),  # the shipped widths; small vocabulary: chance matches
        (3, 15, 9, 1500, 50, False),  # wider than the kernel's block, no room given
        (1, 4, 5, 64, 3, True),
        (15, 15, 10, 200, 20, True),  # MTP's block already as wide as a match's
    ],
)
def test_propose_matches_the_reference(mtp_count, match_drafts, rows, width, vocab, with_room):
    rng = random.Random(mtp_count * 100 + rows)
    contexts = planted_rows(rows, rows, width, vocab)
    tokens, lengths = batch(contexts, width, seed=rows)
    mtp = [[rng.randrange(vocab) for _ in range(mtp_count)] for _ in contexts]
    rooms = [rng.choice([0, 1, 2, 5, 40]) for _ in contexts] if with_room else None
    room_tensor = torch.tensor(rooms, dtype=torch.int32, device=DEVICE) if with_room else None

    drafts, counts = quoting.propose(
        torch.tensor(mtp, dtype=torch.int64, device=DEVICE),
        tokens,
        lengths,
        match_drafts,
        room_tensor,
    )

    assert drafts.shape == (rows, match_drafts) and drafts.dtype == torch.int32
    assert counts.shape == (rows,) and counts.dtype == torch.int32
    long_rows = 0
    for row, context in enumerate(contexts):
        want_drafts, want_count = reference(
            context, mtp[row], match_drafts, rooms[row] if rooms else None
        )
        assert drafts[row].tolist() == want_drafts, row
        assert int(counts[row]) == want_count, row
        long_rows += reference_match(context, *FUSED_MATCH)[0] >= LONG_MATCH
    assert 0 < long_rows < rows  # both kinds of row were exercised


def test_a_copy_proposes_the_long_block_and_chat_keeps_mtps():
    text = list(range(100, 140))
    contexts = [
        [*text, 7, *text[:10]],  # quoting: the last 10 tokens occurred before
        [5, 6, 7, 8, 9, 10, 11, 12],  # chat: nothing repeats
        [1, 2, 3, 4, 1, 2, 3],  # a short chance repeat: MTP's width, its copy only if agreeing
        [1, 2, 3, 4, 5, 50, 9, 1, 2, 3, 4, 5],  # LONG_MATCH - 1 tokens: still MTP's width
        [0, 1, 2, 3, 4, 5, 50, 9, 0, 1, 2, 3, 4, 5],  # LONG_MATCH tokens: the long block
    ]
    matched = [reference_match(c, *FUSED_MATCH)[0] for c in contexts[3:]]
    assert matched == [LONG_MATCH - 1, LONG_MATCH]
    tokens, lengths = batch(contexts, 64, seed=0)
    mtp = torch.tensor([[0, 0, 0], [21, 22, 23], [4, 9, 9], [7, 7, 7], [7, 7, 7]], device=DEVICE)
    drafts, counts = quoting.propose(mtp, tokens, lengths, 15)
    assert counts.tolist() == [15, 3, 3, 3, 15]
    assert drafts[3].tolist() == [7] * 15  # short, disagreeing with MTP: MTP's drafts
    assert drafts[4, :3].tolist() == [50, 9, 0]
    assert drafts[0].tolist() == text[10:25]
    assert drafts[1].tolist() == [21, 22, 23] + [23] * 12
    assert drafts[2, :3].tolist() == [4, 1, 2]  # MTP's first draft agrees with the copy


def test_widths_are_refused_outside_the_search():
    mtp = torch.zeros(2, 4, dtype=torch.int64)
    tokens, lengths = batch([[1, 2], [3]], 8, seed=0)
    with pytest.raises(ValueError, match=r"MTP's drafts \(4\) <= match drafts \(3\)"):
        quoting.propose(mtp, tokens, lengths, 3)
    with pytest.raises(ValueError, match="<= 15"):
        quoting.Widths(3, 16)


def test_the_scheduler_gets_each_requests_last_count_and_mtps_k_before_one():
    widths = quoting.Widths(mtp_drafts=3, match_drafts=15)
    assert widths.placeholders("a") == [-1] * 3  # no report yet: MTP's block
    widths.record(["a", "b", "c"], [15, 3, 0])
    assert [len(widths.placeholders(r)) for r in "abc"] == [15, 3, 0]
    assert widths.placeholders("a") is widths.placeholders("a")  # shared, as vLLM's list is
    widths.record(["a"], [3])  # the match ended
    assert len(widths.placeholders("a")) == 3
    widths.forget("b")
    widths.forget("never-seen")
    assert len(widths.placeholders("b")) == 3


def test_a_count_outside_the_block_is_refused_by_request():
    widths = quoting.Widths(mtp_drafts=3, match_drafts=15)
    with pytest.raises(ValueError, match=r"request 'x': 16 drafts proposed, expected 0\.\.15"):
        widths.record(["x"], [16])
    with pytest.raises(ValueError, match="2 request ids but 1 draft counts"):
        widths.record(["x", "y"], [3])

"""The fused int8 draft-head argmax (kernels/draft_argmax.py) against float64, on the CPU under
Triton's interpreter (conftest turns it on without a GPU): the 27B's head (40,960 rows of
hidden 5120), rows that do not fill a block, hidden rows past one column of BLOCK_B, more
blocks than one reduction chunk, ties (the lowest row wins, as torch.argmax's), bf16 and fp16,
outputs and the partial winners poisoned first, and the tickets left at zero for the next
launch. The GPU side (compiled, many launches, CUDA-graph replay):
tests/test_kernel_draft_argmax_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

from hyperqwen.kernels import draft_argmax
from hyperqwen.kernels.draft_argmax import BLOCK_N, GROUP, REDUCE_BLOCK, Int8DraftHead

HIDDEN_27B, DRAFT_ROWS_27B = 5120, 40_960


def random_head(rows: int, hidden: int, seed: int, vocab: int | None = None):
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (rows, hidden), generator=generator, dtype=torch.int8)
    scales = (torch.rand((rows, hidden // GROUP), generator=generator) * 0.01 + 1e-3).to(
        torch.bfloat16
    )
    vocab = vocab or 3 * rows
    token_ids = torch.sort(torch.randperm(vocab, generator=generator)[:rows]).values
    return codes, scales, token_ids


def float64_rows(codes, scales):
    return codes.double() * scales.double().repeat_interleave(GROUP, dim=1)


def float64_logits(hidden, codes, scales):
    return hidden.double() @ float64_rows(codes, scales).T


def poisoned(head: Int8DraftHead, batch: int):
    """Outputs that are never a result, and partials from an earlier launch made garbage."""
    head._part_val.fill_(float("nan"))
    head._part_row.fill_(-7)
    device = head.codes.device
    ids = torch.full((batch,), -1, dtype=torch.int64, device=device)
    return ids, torch.full((batch,), float("nan"), device=device)


def check(head, hidden, codes, scales, token_ids):
    """Each row's id is the float64 best row's, or (near a tie) a row within fp32 rounding of
    it; its logit is that row's to fp32 rounding."""
    ids, logits = head.top_tokens(hidden, out=poisoned(head, hidden.shape[0]))
    reference = float64_logits(hidden, codes, scales)
    best = reference.max(dim=1).values
    rows = torch.searchsorted(token_ids, ids)
    assert torch.equal(token_ids[rows], ids), "an id that is not a draft-head row's"
    chosen = reference.gather(1, rows[:, None]).squeeze(1)
    tolerance = 1e-5 * reference.abs().max(dim=1).values + 1e-6
    assert ((best - chosen) <= tolerance).all()
    assert torch.allclose(logits.double(), chosen, rtol=1e-5, atol=1e-6)
    distinct = (reference >= (best - 4 * tolerance)[:, None]).sum(dim=1) == 1
    assert torch.equal(ids[distinct], token_ids[reference.argmax(dim=1)][distinct])
    assert not head._tickets.any(), "a ticket left armed for the next launch"
    return ids


@pytest.mark.usefixtures("interpreted")
@pytest.mark.parametrize(
    ("batch", "rows", "hidden", "dtype"),
    [
        (3, DRAFT_ROWS_27B, HIDDEN_27B, torch.bfloat16),  # the 27B's head, first draft pass
        (1, 300, 256, torch.bfloat16),  # the last block part-full
        (17, 200, 128, torch.bfloat16),  # two columns of hidden rows
        (33, 130, 384, torch.float16),  # three columns, fp16 hidden
        (2, 5, 128, torch.bfloat16),  # fewer rows than one block
    ],
)
def test_each_row_gets_its_best_draft_id_and_logit(batch, rows, hidden, dtype):
    codes, scales, token_ids = random_head(rows, hidden, seed=rows + batch)
    head = Int8DraftHead(codes, scales, token_ids)
    generator = torch.Generator().manual_seed(batch)
    x = torch.randn((batch, hidden), generator=generator).to(dtype)
    first = check(head, x, codes, scales, token_ids)
    if rows < DRAFT_ROWS_27B:  # a second launch on the same scratch: tickets from zero again
        assert torch.equal(check(head, x, codes, scales, token_ids), first)


@pytest.mark.usefixtures("interpreted")
@pytest.mark.parametrize(
    "pair",
    [
        (BLOCK_N * (REDUCE_BLOCK + 3) + 5, BLOCK_N * 2 + 1),  # across two reduction chunks
        (70, 65),  # inside one block
        (900, 130),  # across blocks of one chunk
    ],
)
def test_a_tie_goes_to_the_lowest_row(pair):
    rows = BLOCK_N * (REDUCE_BLOCK + 44)  # more blocks than one chunk of the reduction
    codes, scales, token_ids = random_head(rows, GROUP, seed=9)
    codes.clamp_(-20, 20)
    for winner in pair:
        codes[winner] = 127
        scales[winner] = 1.0
    head = Int8DraftHead(codes, scales, token_ids)
    ids, logits = head.top_tokens(
        torch.ones((2, GROUP), dtype=torch.bfloat16), out=poisoned(head, 2)
    )
    assert ids.tolist() == [token_ids[min(pair)]] * 2 and logits.tolist() == [127.0 * GROUP] * 2


@pytest.mark.usefixtures("interpreted")
def test_it_refuses_what_it_cannot_take_saying_what_it_takes():
    codes, scales, token_ids = random_head(64, 256, seed=2)
    with pytest.raises(ValueError, match="multiple of the group size 128"):
        Int8DraftHead(codes[:, :200].contiguous(), scales, token_ids)
    with pytest.raises(ValueError, match="codes must be contiguous int8"):
        Int8DraftHead(codes.to(torch.int32), scales, token_ids)
    with pytest.raises(ValueError, match=r"token_ids must be int64 \[64\]"):
        Int8DraftHead(codes, scales, token_ids.to(torch.int32))
    head = Int8DraftHead(codes, scales, token_ids)
    with pytest.raises(ValueError, match=r"takes \[B, 256\] bf16/fp16 rows"):
        head.top_tokens(torch.randn(2, 256))  # fp32
    with pytest.raises(ValueError, match=r"takes \[B, 256\]"):
        head.top_tokens(torch.randn(256, 2, dtype=torch.bfloat16).T)  # strided columns
    with pytest.raises(ValueError, match="out must be contiguous"):
        head.top_tokens(torch.randn(2, 256, dtype=torch.bfloat16), out=poisoned(head, 3))
    ids, logits = head.top_tokens(torch.randn(0, 256, dtype=torch.bfloat16))
    assert ids.shape == logits.shape == (0,)


def test_blocks_are_what_the_kernel_is_built_for():
    assert draft_argmax.BLOCK_B == 16  # tl.dot's smallest M
    assert GROUP == 128 and BLOCK_N % 16 == 0 and REDUCE_BLOCK & (REDUCE_BLOCK - 1) == 0

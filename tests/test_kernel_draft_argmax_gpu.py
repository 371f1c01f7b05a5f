"""The fused int8 draft-head argmax (kernels/draft_argmax.py) compiled on a GPU, at the 27B's
head: every batch a draft pass has, many launches in a row (each must see only its own
partials and leave its tickets at zero), and replays of a captured CUDA graph with new inputs.

Run on the GPU host: `pytest -m gpu tests/test_kernel_draft_argmax_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch
from gpu_server import require_gpu
from test_kernel_draft_argmax import DRAFT_ROWS_27B, HIDDEN_27B, check, float64_rows, random_head

from hyperqwen.kernels.draft_argmax import Int8DraftHead

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def head_27b():
    require_gpu()
    codes, scales, token_ids = (t.cuda() for t in random_head(DRAFT_ROWS_27B, HIDDEN_27B, seed=3))
    return Int8DraftHead(codes, scales, token_ids), codes, scales, token_ids


@pytest.mark.parametrize("batch", [1, 2, 4, 8, 16, 17, 64])
def test_each_batch_matches_float64(head_27b, batch):
    head, codes, scales, token_ids = head_27b
    hidden = torch.randn((batch, HIDDEN_27B), device="cuda").bfloat16()
    check(head, hidden, codes, scales, token_ids)


def test_many_launches_in_a_row_each_give_their_own_best_row(head_27b):
    head, codes, scales, token_ids = head_27b
    exact = float64_rows(codes, scales)  # once for the 200 launches
    inputs = [torch.randn((4, HIDDEN_27B), device="cuda").bfloat16() for _ in range(200)]
    results = [head.top_tokens(hidden)[0] for hidden in inputs]  # no sync between launches
    torch.cuda.synchronize()
    for hidden, ids in zip(inputs, results, strict=True):
        reference = hidden.double() @ exact.T
        chosen = reference.gather(1, torch.searchsorted(token_ids, ids)[:, None]).squeeze(1)
        assert (reference.max(dim=1).values - chosen <= 1e-4 * reference.abs().max()).all()
    assert not head._tickets.any()


def test_a_captured_graph_replays_with_new_inputs(head_27b):
    head, codes, scales, token_ids = head_27b
    static = torch.randn((3, HIDDEN_27B), device="cuda").bfloat16()
    head.top_tokens(static)  # scratch allocated before capture, as a warm-up does
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids, logits = head.top_tokens(static)
    for _ in range(5):
        static.copy_(torch.randn((3, HIDDEN_27B), device="cuda").bfloat16())
        graph.replay()
        eager_ids, eager_logits = head.top_tokens(static)
        assert torch.equal(ids, eager_ids) and torch.equal(logits, eager_logits)
    check(head, static, codes, scales, token_ids)

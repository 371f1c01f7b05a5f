"""kvarn/step_tensors.py: the build's one copy and one kernel against the torch operations
they replace, on random batches (Triton's interpreter on the CPU), every output poisoned
first."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hyperqwen.kvarn.step_tensors import StepBuffers, host_lists, write_step_tensors

T = 128
POISON = -7


def reference(plan, mapping, seq_lens, query_start_loc, stores, padding_row):
    """The builder's torch operations before the kernel (backend.py up to 2026-12-06)."""
    slot_of_block = plan.slot_of_block
    token_slots = slot_of_block[mapping.clamp(min=0) // T].long()
    valid = (mapping >= 0) & (token_slots >= 0)
    side_rows = torch.where(valid, token_slots * T + mapping % T, padding_row)
    candidates = torch.zeros(4, stores, dtype=torch.int64)
    candidates[0] = -1
    count = len(plan.store_blocks)
    lists = [plan.store_blocks, plan.store_slots, plan.store_rows, plan.store_ends]
    candidates[:, :count] = torch.tensor(lists, dtype=torch.int64).view(4, count)
    blocks, slots, rows, ends = candidates
    after = seq_lens.long()[rows]
    before = after - (query_start_loc.long()[rows + 1] - query_start_loc.long()[rows])
    store_blocks = torch.where((before < ends) & (ends <= after), blocks, -1)
    return slot_of_block, side_rows, store_blocks, slots


def random_step(num_blocks, num_reqs, tokens_per_req, count, seed):
    """A batch of num_reqs requests of tokens_per_req new tokens each, then 5 padding tokens
    (slot -1), a slot map with blocks unmapped, and `count` candidate tiles whose ends fall
    at and beside the edges of their request's new tokens."""
    g = torch.Generator().manual_seed(seed)
    slot_of_block = torch.randint(-1, 50, (num_blocks,), dtype=torch.int32, generator=g)
    seq_lens = torch.randint(tokens_per_req, 40 * T, (num_reqs,), dtype=torch.int32, generator=g)
    starts = [0]
    mapping = []
    for length in seq_lens.tolist():
        blocks = torch.randint(0, num_blocks, (length // T + 1,), generator=g)
        positions = range(length - tokens_per_req, length)
        mapping += [int(blocks[p // T]) * T + p % T for p in positions]
        starts.append(starts[-1] + tokens_per_req)
    mapping = torch.tensor(mapping + [-1] * 5, dtype=torch.int64)
    rows = torch.randint(0, num_reqs, (count,), generator=g).tolist()
    # ends at and beside both edges of (seq_len - query_len, seq_len]
    edges = torch.tensor([-tokens_per_req - 1, -tokens_per_req, -tokens_per_req + 1, -1, 0, 1])
    shift = edges[torch.randint(0, len(edges), (count,), generator=g)]
    ends = [int(seq_lens[r]) + int(s) for r, s in zip(rows, shift, strict=True)]
    plan = SimpleNamespace(
        slot_of_block=slot_of_block,
        store_blocks=torch.randint(0, num_blocks, (count,), generator=g).tolist(),
        store_slots=torch.randint(0, 50, (count,), generator=g).tolist(),
        store_rows=rows,
        store_ends=ends,
    )
    query_start_loc = torch.tensor(starts, dtype=torch.int32)
    return plan, mapping, seq_lens, query_start_loc


@pytest.mark.usefixtures("interpreted", "vllm_cpu_platform")
@pytest.mark.parametrize(
    ("num_blocks", "num_reqs", "tokens_per_req", "count", "stores"),
    [
        (40, 1, 4, 1, 1),  # a C1 verify block, its one candidate
        (40, 3, 4, 0, 3),  # no candidates: the padded list alone
        (3000, 2, 1, 12, 16),  # the slot map past one program (STEP_BLOCK), lists padded
        (20, 4, 600, 12, 12),  # tokens past one program (prefill chunks), more than the map
    ],
)
def test_one_copy_and_one_kernel_write_what_the_torch_operations_did(
    num_blocks, num_reqs, tokens_per_req, count, stores
):
    plan, mapping, seq_lens, query_start_loc = random_step(
        num_blocks, num_reqs, tokens_per_req, count, seed=num_blocks + count
    )
    config = SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=4096)
    )
    buffers = StepBuffers(num_blocks, 16, config, "cpu")
    for name in ("slot_of_block", "side_rows", "store_blocks", "store_slots", "staged"):
        getattr(buffers, name).fill_(POISON)
    padding_row = 16 * T
    got = write_step_tensors(buffers, plan, mapping, seq_lens, query_start_loc, stores,
                             padding_row)  # fmt: skip
    want = reference(plan, mapping, seq_lens, query_start_loc, stores, padding_row)
    for name, g, w in zip(("slot_of_block", "side_rows", "store_blocks", "store_slots"), got,
                          want, strict=True):  # fmt: skip
        assert torch.equal(g.long(), w.long()), name
    # the views are the buffers' own (a CUDA graph reads them where it was captured)
    assert got[1].data_ptr() == buffers.side_rows.data_ptr()
    assert (buffers.side_rows[mapping.shape[0] :] == POISON).all()  # nothing past the step
    assert (got[1][-5:] == padding_row).all()  # the padding tokens


def test_the_lists_are_refused_when_they_outgrow_the_buffers():
    config = SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_seqs=2, max_num_batched_tokens=64)
    )
    buffers = StepBuffers(10, 3, config, "cpu")
    plan = SimpleNamespace(
        slot_of_block=torch.full((10,), -1, dtype=torch.int32),
        store_blocks=[1, 2, 3, 4], store_slots=[0, 1, 2, 0], store_rows=[0] * 4,
        store_ends=[128] * 4,
    )  # fmt: skip
    empty = torch.empty(0, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="4 store candidates in lists of 4, buffers of 3"):
        write_step_tensors(buffers, plan, empty, empty.int(), empty.int(), 4, 0)
    plan.slot_of_block = torch.full((11,), -1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="maps 11 pool blocks, the builder's buffer 10"):
        write_step_tensors(buffers, plan, empty, empty.int(), empty.int(), 3, 0)


def test_the_host_lists_pad_blocks_with_minus_one():
    host = host_lists(torch.tensor([5, -1], dtype=torch.int32), [[7], [2], [0], [256]], 3)
    assert host.tolist() == [5, -1, 7, -1, -1, 2, 0, 0, 0, 0, 0, 256, 0, 0]

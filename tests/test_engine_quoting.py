"""Quoting's variable verify width (engine/quoting.py) against a per-row Python reference.

`propose` runs on the GPU in the engine; here its search kernel runs in Triton's interpreter
(conftest) and its tensor ops on the CPU. Rows are random contexts with copies planted at their
ends (tests/test_kernel_lookup.py's generator), MTP's drafts random. The step's cut of the
scheduled drafts runs on vLLM's own SchedulerOutput and is checked against vLLM's cut for its GPU
n-gram drafter; the runner hooks run on the attributes vLLM's runner gives them.
"""

from __future__ import annotations

import random
import types

import pytest
import torch
from test_kernel_lookup import planted_rows, reference_drafts, reference_match

from hyperqwen.engine import quoting, seams
from hyperqwen.engine.features import LOOKUP, MTP_DRAFTS
from hyperqwen.engine.lookup import FUSED_MATCH, LONG_MATCH

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(context: list[int], mtp: list[int], match_drafts: int):
    """One row's drafts and count, written out: the copy where the match is long, or short and
    agreeing with MTP's first draft; MTP's drafts otherwise; each padded with its last draft.
    The count is the match width for a long match, MTP's k otherwise."""
    n, j = reference_match(context, *FUSED_MATCH)
    copy = reference_drafts(context, n, j, match_drafts)
    if n and (n >= LONG_MATCH or copy[0] == mtp[0]):
        drafts = copy
    else:
        drafts = mtp + [mtp[-1]] * (match_drafts - len(mtp))
    return drafts, match_drafts if n >= LONG_MATCH else len(mtp)


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
    ("mtp_count", "match_drafts", "rows", "width", "vocab"),
    [
        (3, 15, 16, 300, 7),  # the shipped widths; small vocabulary: chance matches
        (3, 15, 9, 1500, 50),  # wider than the kernel's block
        (1, 4, 5, 64, 3),
        (15, 15, 10, 200, 20),  # MTP's block already as wide as a match's
    ],
)
def test_propose_matches_the_reference(mtp_count, match_drafts, rows, width, vocab):
    rng = random.Random(mtp_count * 100 + rows)
    contexts = planted_rows(rows, rows, width, vocab)
    tokens, lengths = batch(contexts, width, seed=rows)
    mtp = [[rng.randrange(vocab) for _ in range(mtp_count)] for _ in contexts]

    drafts, counts = quoting.propose(
        torch.tensor(mtp, dtype=torch.int64, device=DEVICE), tokens, lengths, match_drafts
    )

    assert drafts.shape == (rows, match_drafts) and drafts.dtype == torch.int32
    assert counts.shape == (rows,) and counts.dtype == torch.int32
    long_rows = 0
    for row, context in enumerate(contexts):
        want_drafts, want_count = reference(context, mtp[row], match_drafts)
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
    with pytest.raises(ValueError, match=r"match drafts \(16\) <= 15"):
        quoting.propose(mtp, tokens, lengths, 16)


def scheduled_step(drafts_per_request: dict[str, int]):
    """vLLM's SchedulerOutput of a decode step: 1 + the scheduled drafts for each request, plus a
    prefill chunk without drafts."""
    from vllm.v1.core.sched.output import SchedulerOutput

    output = SchedulerOutput.make_empty()
    output.scheduled_cached_reqs.req_ids = [*drafts_per_request, "prefilling"]
    for req_id, count in drafts_per_request.items():
        output.scheduled_spec_decode_tokens[req_id] = [-1] * count
        output.num_scheduled_tokens[req_id] = 1 + count
    output.num_scheduled_tokens["prefilling"] = 100
    output.total_num_scheduled_tokens = sum(output.num_scheduled_tokens.values())
    return output


def test_the_cut_keeps_what_was_proposed_and_mtps_k_for_the_unknown():
    step = scheduled_step({"copying": 15, "chatting": 15, "new": 15, "ending": 15, "short": 2})
    proposed = {"copying": 15, "chatting": 3, "ending": 0, "short": 15, "gone": 15}
    original = quoting.trim_to_proposed(step, proposed, mtp_drafts=3)
    assert original == {"copying": 15, "chatting": 15, "new": 15, "ending": 15, "short": 2}
    assert {r: len(d) for r, d in step.scheduled_spec_decode_tokens.items()} == {
        "copying": 15,
        "chatting": 3,
        "new": 3,  # no count reported yet: MTP's block
        "short": 2,  # never more than the scheduler gave
    }  # "ending" proposed nothing: no drafts left
    assert step.num_scheduled_tokens == {
        "copying": 16,
        "chatting": 4,
        "new": 4,
        "ending": 1,
        "short": 3,
        "prefilling": 100,
    }
    assert step.total_num_scheduled_tokens == 16 + 4 + 4 + 1 + 3 + 100


def test_the_cut_is_vllms_own_for_the_same_counts(vllm_cpu_platform):
    """vLLM's GPU n-gram drafter cuts with update_scheduler_for_invalid_drafts after waiting for
    this step's counts; quoting's cut, given the same counts by request, leaves the same step."""
    from vllm.v1.spec_decode.ngram_proposer_gpu import update_scheduler_for_invalid_drafts

    scheduled = {"a": 15, "b": 15, "c": 3, "d": 15}
    counts = {"a": 15, "b": 3, "c": 3, "d": 0}
    ours, theirs = scheduled_step(scheduled), scheduled_step(scheduled)
    quoting.trim_to_proposed(ours, counts)
    index = {req_id: i for i, req_id in enumerate(scheduled)}
    update_scheduler_for_invalid_drafts(
        types.SimpleNamespace(synchronize=lambda: None),  # the copy is done: host memory here
        torch.tensor([counts[r] for r in scheduled], dtype=torch.int32),
        theirs,
        index,
    )
    assert ours.scheduled_spec_decode_tokens == theirs.scheduled_spec_decode_tokens
    assert ours.num_scheduled_tokens == theirs.num_scheduled_tokens
    assert ours.total_num_scheduled_tokens == theirs.total_num_scheduled_tokens


def test_counts_are_read_one_step_late_by_request():
    counts = quoting.ProposedCounts(max_reqs=4, device="cpu")
    assert counts.previous() == {}  # nothing published yet
    counts.publish(torch.tensor([15, 3], dtype=torch.int32), ["a", "b"])
    assert counts.previous() == {}  # the newest is the step being drafted
    counts.publish(torch.tensor([3, 15, 15], dtype=torch.int32), ["b", "a", "c"])
    assert counts.previous() == {"a": 15, "b": 3}
    counts.publish(torch.tensor([0], dtype=torch.int32), ["c", "padding", "rows"])
    assert counts.previous() == {"b": 3, "a": 15, "c": 15}


def runner(num_speculative_tokens: int, method: str = "mtp", rows: int = 3):
    """What quoting's hooks read of vLLM's V1 runner, as it has them for MTP with lookup."""
    spec = types.SimpleNamespace(
        method=method,
        draft_sample_method="greedy",
        num_speculative_tokens=num_speculative_tokens,
    )
    return types.SimpleNamespace(
        speculative_config=spec,
        uniform_decode_query_len=1 + num_speculative_tokens,
        cudagraph_dispatcher=types.SimpleNamespace(
            uniform_decode_query_len=1 + num_speculative_tokens
        ),
        max_num_reqs=rows,
        device=torch.device("cpu"),
        token_ids_gpu_tensor=torch.zeros(rows, 64, dtype=torch.int32),
        num_tokens_no_spec_gpu=torch.zeros(rows, dtype=torch.int32),
        discard_request_mask=types.SimpleNamespace(gpu=torch.zeros(rows, dtype=torch.bool)),
        input_batch=types.SimpleNamespace(vocab_size=1000, req_ids=[f"r{i}" for i in range(rows)]),
    )


@pytest.mark.parametrize(
    ("lookup", "method", "slots", "widens"),
    [
        ("auto", "mtp", 15, True),
        ("1", "mtp", 8, True),
        ("auto", "mtp", MTP_DRAFTS, False),  # MTP's own block: the fused path of lookup.py
        ("0", "mtp", 15, False),  # lookup off: MTP drafts all 15, as vLLM does
        ("auto", "ngram_gpu", 15, False),
    ],
)
def test_hooks_are_inert_unless_quoting_widens(monkeypatch, lookup, method, slots, widens):
    """Through the V1 runner's seams, as vLLM calls them (lookup 0: seams.py calls none)."""
    monkeypatch.setenv(LOOKUP.env, lookup)
    the_runner = runner(slots, method)
    seams.runner_graphs_dispatched(the_runner)
    assert seams.runner_copies_scheduler_output(the_runner) is widens
    graphs = 1 + (MTP_DRAFTS if widens else slots)
    assert the_runner.uniform_decode_query_len == graphs
    assert the_runner.cudagraph_dispatcher.uniform_decode_query_len == graphs
    assert seams.runner_draft_count(the_runner, slots) == (MTP_DRAFTS if widens else slots)
    step = scheduled_step({"r0": slots})
    assert seams.runner_cut_drafts(the_runner, step) == ({"r0": slots} if widens else {})
    assert len(step.scheduled_spec_decode_tokens["r0"]) == (MTP_DRAFTS if widens else slots)


def test_a_drafting_step_writes_the_buffer_fuses_and_publishes_its_counts(monkeypatch):
    """Two drafting steps on a runner with 15 slots: row 0 quotes its context, row 1 chats; the
    second step's cut reads the first step's counts. Through the seams, as vLLM calls them."""
    monkeypatch.setenv(LOOKUP.env, "auto")
    text = list(range(100, 140))
    contexts = [[*text, 7, *text[:9]], [5, 6, 7, 8, 9]]
    the_runner = runner(15, rows=2)
    seams.runner_graphs_dispatched(the_runner)
    for row, context in enumerate(contexts):
        the_runner.token_ids_gpu_tensor[row, : len(context)] = torch.tensor(context)
        the_runner.num_tokens_no_spec_gpu[row] = len(context)
    sampled = torch.tensor([[text[9], text[10], -1, -1], [11, -1, -1, -1]])  # accepted this step
    mtp = torch.tensor([[1, 2, 3], [12, 13, 14]])

    drafted = seams.runner_drafted(the_runner, mtp, sampled)
    assert drafted.dtype == mtp.dtype and drafted.shape == (2, 15)
    assert drafted[0].tolist() == text[11:26]  # the copy, 15 long
    assert drafted[1].tolist() == [12, 13, 14] + [14] * 12
    assert the_runner.token_ids_gpu_tensor[0, len(contexts[0]) : len(contexts[0]) + 2].tolist() == [
        text[9],
        text[10],
    ]

    seams.runner_drafted(the_runner, mtp, sampled)  # the next step drafts
    step = scheduled_step({"r0": 15, "r1": 15})
    seams.runner_cut_drafts(the_runner, step)
    assert step.num_scheduled_tokens == {"r0": 16, "r1": 4, "prefilling": 100}

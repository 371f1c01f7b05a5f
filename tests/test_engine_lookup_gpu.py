"""SPEC=lookup on the GPU (LOOKUP_DEVICE=gpu: engine/lookup_gpu.py) on the attributes vLLM's V1
runner gives it for `ngram_gpu`, with vLLM's own SchedulerOutput, `update_token_ids_ngram` and
synchronous cut; the search kernel runs in Triton's interpreter (conftest).

Each step is what the runner does under async scheduling: `_update_states` (vLLM's cut, then the
`runner_cut_drafts` seam) on the scheduler's output, where every decoding request was scheduled
W placeholders; after sampling, vLLM's `update_token_ids_ngram`, then `self.drafter.propose`.
"""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import torch
from test_engine_quoting import scheduled_step
from test_kernel_lookup import as_buffer, planted_rows

from hyperqwen.engine import lookup, lookup_gpu, seams
from hyperqwen.engine.features import LOOKUP
from hyperqwen.kernels.lookup import find_suffix_match
from hyperqwen.launch import LOOKUP_MATCH

WIDTH = 15  # DRAFT_TOKENS, the bench's
BUFFER = 128  # max_model_len
RUNNER_MODULE = "hq_test_gpu_model_runner"


class Waited(AssertionError):
    """vLLM's cut waited for the GPU."""


def _wait():
    raise Waited("synchronized")


@pytest.fixture
def runner_module(monkeypatch, vllm_cpu_platform):
    """A stand-in for vllm.v1.worker.gpu_model_runner's namespace: vLLM's cut by the name the
    runner calls it by (a runner's class names its module; attach substitutes there)."""
    from vllm.v1.spec_decode.ngram_proposer_gpu import update_scheduler_for_invalid_drafts

    module = types.ModuleType(RUNNER_MODULE)
    module.update_scheduler_for_invalid_drafts = update_scheduler_for_invalid_drafts
    monkeypatch.setitem(sys.modules, RUNNER_MODULE, module)
    return module


def make_runner(rows: int = 3, method: str = "ngram_gpu", width: int = WIDTH):
    """What the runner has for `ngram_gpu` once its drafter and CUDA graph dispatcher exist."""
    vllms_class = type(
        "GPUModelRunner", (), {"__module__": RUNNER_MODULE, "_update_states": lambda self: None}
    )
    # a platform's subclass elsewhere: the cut is looked up where _update_states is defined
    runner = type("PlatformRunner", (vllms_class,), {"__module__": __name__})()
    runner.speculative_config = types.SimpleNamespace(
        method=method,
        draft_sample_method="greedy",
        num_speculative_tokens=width,
        prompt_lookup_min=LOOKUP_MATCH[0],
        prompt_lookup_max=LOOKUP_MATCH[1],
    )
    runner.uniform_decode_query_len = 1 + width
    runner.cudagraph_dispatcher = types.SimpleNamespace(uniform_decode_query_len=1 + width)
    runner.max_num_reqs = rows
    runner.max_model_len = BUFFER
    runner.device = torch.device("cpu")
    runner.token_ids_gpu_tensor = torch.zeros(rows, BUFFER, dtype=torch.int32)
    runner.num_tokens_no_spec_gpu = torch.zeros(rows, dtype=torch.int32)
    runner.discard_request_mask = types.SimpleNamespace(gpu=torch.zeros(rows, dtype=torch.bool))
    runner.input_batch = types.SimpleNamespace(vocab_size=1000, req_ids=[], num_reqs=0)
    runner.drafter = types.SimpleNamespace(propose=None)  # vLLM's NgramProposerGPU.propose
    runner._num_valid_draft_tokens_event = types.SimpleNamespace(synchronize=_wait)
    runner._num_valid_draft_tokens_cpu = torch.zeros(rows, dtype=torch.int32)
    return runner


def update_states(runner, module, scheduled: dict[str, int]):
    """_update_states' cut as the patched runner runs it: vLLM's (for ngram_gpu), then the seam;
    the scheduled counts kept for vLLM's rejection correction."""
    step = scheduled_step(scheduled)
    original = {req_id: len(drafts) for req_id, drafts in step.scheduled_spec_decode_tokens.items()}
    module.update_scheduler_for_invalid_drafts(
        runner._num_valid_draft_tokens_event,
        runner._num_valid_draft_tokens_cpu,
        step,
        {req_id: i for i, req_id in enumerate(runner.input_batch.req_ids)},
    )
    original.update(seams.runner_cut_drafts(runner, step))
    return step, original


def draft(runner, sampled: list[list[int]]):
    """After sampling: vLLM's update_token_ids_ngram (it must not write the buffer), then the
    drafter's propose with the runner's arguments; the step's accepted tokens then count."""
    from vllm.v1.spec_decode.ngram_proposer_gpu import NgramProposerGPU

    rows = len(sampled)
    padded = torch.tensor([row + [-1] * (WIDTH + 1 - len(row)) for row in sampled])
    runner.input_batch.num_reqs = rows
    before = runner.token_ids_gpu_tensor.clone()
    _, count, valid = NgramProposerGPU.update_token_ids_ngram(
        types.SimpleNamespace(device=runner.device),
        padded,
        runner.input_batch,
        runner.token_ids_gpu_tensor,
        runner.num_tokens_no_spec_gpu,
        runner.discard_request_mask.gpu,
    )
    assert torch.equal(runner.token_ids_gpu_tensor, before)  # vLLM wrote nothing: ours writes
    drafts, valid_counts = runner.drafter.propose(
        WIDTH,
        runner.num_tokens_no_spec_gpu[:rows],
        runner.token_ids_gpu_tensor[:rows],
        valid,
        count,
    )
    assert valid_counts is None  # vLLM copies none, so its cut has nothing to wait for
    assert drafts.shape == (rows, WIDTH) and drafts.dtype == torch.int32
    # the runner's bookkeeping (next _update_states, with its correction) advances the counts
    runner.num_tokens_no_spec_gpu[:rows] += count
    return drafts


def load(runner, row: int, req_id: str, context: list[int]):
    """A new request's tokens, as update_ngram_gpu_tensors_incremental copies them."""
    runner.token_ids_gpu_tensor[row, : len(context)] = torch.tensor(context, dtype=torch.int32)
    runner.num_tokens_no_spec_gpu[row] = len(context)
    runner.input_batch.req_ids.append(req_id)


def test_steps_copy_a_long_block_one_step_late_and_decode_plainly_elsewhere(
    monkeypatch, runner_module
):
    """r0 copies its prompt, r1 repeats nothing, r2 arrives at step 2 copying too. Step k's cut
    reads step k-2's counts: 0 until a count is known, then W for a copy, 0 without a match."""
    monkeypatch.setenv(LOOKUP.env, "gpu")
    text = list(range(100, 140))
    copying = [*text, 7, *text[:9]]  # its last 9 tokens occurred before
    unique = list(range(500, 520))
    runner = make_runner()
    seams.runner_graphs_dispatched(runner)
    assert seams.runner_copies_scheduler_output(runner)
    load(runner, 0, "r0", copying)
    load(runner, 1, "r1", unique)

    # step 1: no count yet: every request's W placeholders are cut to a plain decode
    step, original = update_states(runner, runner_module, {"r0": WIDTH, "r1": WIDTH})
    assert step.scheduled_spec_decode_tokens == {}
    assert step.num_scheduled_tokens == {"r0": 1, "r1": 1, "prefilling": 100}
    assert step.total_num_scheduled_tokens == 102
    assert original == {"r0": WIDTH, "r1": WIDTH}  # vLLM's rejection correction reads these
    drafts = draft(runner, [[text[9]], [520]])
    assert drafts[0].tolist() == text[10 : 10 + WIDTH]  # the copy's continuation
    assert drafts[1].tolist() == [520] * WIDTH  # no match: the last token, a valid id
    assert runner.token_ids_gpu_tensor[0, len(copying)] == text[9]  # accepted, written once
    assert runner.token_ids_gpu_tensor[1, len(unique)] == 520

    # step 2: r0 verified nothing, so it sampled one token; r2 is new
    load(runner, 2, "r2", copying)
    step, _ = update_states(runner, runner_module, {"r0": WIDTH, "r1": WIDTH})
    assert step.num_scheduled_tokens == {"r0": 1, "r1": 1, "prefilling": 100}
    drafts = draft(runner, [[text[10]], [521], [text[9]]])
    assert drafts[0].tolist() == text[11 : 11 + WIDTH]
    assert drafts[2].tolist() == text[10 : 10 + WIDTH]

    # step 3: step 1's counts: r0 verifies all W, r1 decodes plainly, r2 has no count yet
    step, original = update_states(runner, runner_module, {"r0": WIDTH, "r1": WIDTH, "r2": WIDTH})
    assert {r: len(d) for r, d in step.scheduled_spec_decode_tokens.items()} == {"r0": WIDTH}
    assert step.num_scheduled_tokens == {"r0": 1 + WIDTH, "r1": 1, "r2": 1, "prefilling": 100}
    assert original == {"r0": WIDTH, "r1": WIDTH, "r2": WIDTH}
    # r0 accepted 4 of its drafts and the bonus token
    draft(runner, [[*text[11:16]], [522], [text[10]]])
    row = runner.token_ids_gpu_tensor[0]
    assert row[len(copying) : len(copying) + 7].tolist() == text[9:16]

    # step 4: step 2's counts: r2's copy now verifies all W too
    step, _ = update_states(runner, runner_module, {"r0": WIDTH, "r1": WIDTH, "r2": WIDTH})
    assert {r: len(d) for r, d in step.scheduled_spec_decode_tokens.items()} == {
        "r0": WIDTH,
        "r2": WIDTH,
    }


def test_vllms_synchronous_cut_is_skipped_only_on_this_path(monkeypatch, runner_module):
    """The runner calls vLLM's cut by its module-global name: with HYPERQWEN_LOOKUP=gpu nothing
    is waited for (the event the runner's constructor sets after the seam, never recorded on
    this path) or cut there; with another value it is vLLM's cut."""
    monkeypatch.setenv(LOOKUP.env, "gpu")
    vllms = runner_module.update_scheduler_for_invalid_drafts
    runner = make_runner()
    seams.runner_graphs_dispatched(runner)
    seams.runner_graphs_dispatched(make_runner())  # a second attach wraps nothing twice
    skipping = runner_module.update_scheduler_for_invalid_drafts
    assert skipping is not vllms and skipping.hq_vllms_cut is vllms

    step = scheduled_step({"a": WIDTH})
    never_read = types.SimpleNamespace()  # vLLM's cut would index its counts
    skipping(types.SimpleNamespace(synchronize=_wait), never_read, step, {"a": 0})
    assert len(step.scheduled_spec_decode_tokens["a"]) == WIDTH

    monkeypatch.setenv(LOOKUP.env, "1")
    other = scheduled_step({"a": WIDTH})
    done = types.SimpleNamespace(synchronize=lambda: None)
    skipping(done, torch.tensor([2], dtype=torch.int32), other, {"a": 0})
    assert len(other.scheduled_spec_decode_tokens["a"]) == 2  # vLLM's cut, as before


@pytest.mark.parametrize(
    ("value", "method", "ours"),
    [
        ("gpu", "ngram_gpu", True),
        ("1", "ngram_gpu", False),  # vLLM's ngram_gpu alone: its kernel, its cut
        ("gpu", "ngram", False),
        ("0", "ngram_gpu", False),
    ],
)
def test_the_path_needs_ngram_gpu_and_the_gpu_value(
    monkeypatch, runner_module, value, method, ours
):
    """Full CUDA graphs for 1-token decodes on this path (a step without drafts keeps its
    FULL graph); elsewhere the runner's graphs, drafter and cut are left alone."""
    monkeypatch.setenv(LOOKUP.env, value)
    runner = make_runner(method=method)
    vllms_propose = runner.drafter.propose = object()
    seams.runner_graphs_dispatched(runner)
    assert runner.uniform_decode_query_len == (1 if ours else 1 + WIDTH)
    assert runner.cudagraph_dispatcher.uniform_decode_query_len == runner.uniform_decode_query_len
    assert (runner.drafter.propose is not vllms_propose) is ours
    step = scheduled_step({"a": WIDTH})
    assert seams.runner_cut_drafts(runner, step) == ({"a": WIDTH} if ours else {})


def test_the_count_policy():
    """Any match proposes W, none or a row that sampled nothing 0, and never past
    max_model_len."""
    match = torch.tensor([6, 2, 0, 12, 12, 3], dtype=torch.int32)
    sampled = torch.tensor([1, 2, 1, 0, 1, 1], dtype=torch.int32)
    lengths = torch.tensor([50, 50, 50, 50, BUFFER - 5, BUFFER], dtype=torch.int32)
    counts = lookup_gpu.proposed_counts(match, sampled, lengths, WIDTH, BUFFER)
    assert counts.dtype == torch.int32
    assert counts.tolist() == [WIDTH, WIDTH, 0, 0, 5, 0]
    assert lookup_gpu.proposed_counts(match[:2], sampled[:2], lengths[:2], 2, BUFFER).tolist() == [
        2,
        2,
    ]


@pytest.mark.parametrize(("seed", "vocab", "min_n", "max_n"), [(0, 4, 1, 8), (1, 30, 2, 12)])
def test_both_devices_propose_the_same_drafts(seed, vocab, min_n, max_n):
    """The policy is written twice, once a request on the host (LOOKUP_DEVICE's cpu value) and
    once a batch on the GPU: the same contexts give the same drafts and counts on both, near
    max_model_len too."""
    contexts = planted_rows(seed, 60, BUFFER, vocab)
    tokens, lengths = as_buffer(contexts, BUFFER)
    match = find_suffix_match(tokens, lengths, min_n, max_n, WIDTH)
    sampled = torch.ones_like(lengths)
    counts = lookup_gpu.proposed_counts(match.length, sampled, lengths, WIDTH, BUFFER).tolist()
    assert {0, WIDTH} <= set(counts)  # both branches of the policy ran
    for row, context in enumerate(contexts):
        on_host = lookup.propose(np.array(context, dtype=np.int32), min_n, max_n, WIDTH, BUFFER)
        assert match.drafts[row, : counts[row]].tolist() == on_host, (row, context[-20:])


def test_the_patched_runner_calls_what_attach_replaces(patched_vllm):
    """attach substitutes by name: vLLM's cut is looked up as a global of the runner's module,
    the drafter's propose as an attribute of the drafter (an instance attribute wins), and its
    valid-draft counts are copied only when not None."""
    runner = (patched_vllm / "v1" / "worker" / "gpu_model_runner.py").read_text()
    # the seam runs after the drafter and the runner's uniform decode width are set, and after
    # nothing attach sets is set again
    seam = runner.index("seams.runner_graphs_dispatched(self)")
    assert runner.index("self.drafter = NgramProposerGPU(") < seam
    assert runner.index("self.uniform_decode_query_len = 1 + self.num_spec_tokens") < seam
    for attribute in ("uniform_decode_query_len", "drafter", "hq_proposed", "hq_no_count"):
        assert f"self.{attribute} = " not in runner[seam:], attribute
    assert "self.drafter.propose = " not in runner
    assert "    update_scheduler_for_invalid_drafts,\n" in runner  # imported into the namespace
    assert (
        "update_scheduler_for_invalid_drafts(\n" + " " * 16 + "self._num_valid_draft_tokens_event,"
        in runner
    )
    assert (
        "draft_token_ids, num_valid_draft_tokens = self.drafter.propose(\n"
        + " " * 16
        + "num_spec_tokens_to_schedule,\n"
        + " " * 16
        + "self.num_tokens_no_spec_gpu[:batch_size],\n"
        + " " * 16
        + "self.token_ids_gpu_tensor[:batch_size],"
        in runner
    )
    proposer = (patched_vllm / "v1" / "spec_decode" / "ngram_proposer_gpu.py").read_text()
    copy = proposer[proposer.index("def copy_num_valid_draft_tokens(") :]
    assert "if num_valid_draft_tokens is None:\n        return" in copy

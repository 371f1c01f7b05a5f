"""Prefix caching without the per-step wait (engine/align_overlap.py, patches/align-overlap.patch):
which steps may skip it, the counts taken on the GPU instead, and the runner's use of both.

The runner itself cannot run on a CPU; test_engine_align_overlap_gpu.py compares its output
with and without the overlap on a GPU.
"""

from __future__ import annotations

import ast
import types

import pytest
import torch

from hyperqwen.engine import align_overlap

BLOCK = 16
DRAFTS = 3


def request(computed: int):
    return types.SimpleNamespace(num_computed_tokens=computed)


def safe(computed: dict[str, int], scheduled: dict[str, int], blocks: dict[str, int], **kw):
    return align_overlap.step_is_safe(
        {name: request(value) for name, value in computed.items()},
        list(computed),
        scheduled,
        blocks,
        kw.get("restarted", set()),
        BLOCK,
        DRAFTS,
    )


@pytest.mark.parametrize(
    ("computed", "expected"),
    [(15, False), (16, True), (20, True), (28, True), (29, False)],
)
def test_a_step_is_safe_only_far_from_a_block_boundary(computed, expected):
    # The request's running state is in block 1 (tokens 17..32 of 16-token blocks). This step
    # schedules 1 + 3 drafts on an optimistic count that assumed the previous step's 3 drafts
    # were accepted: its last token is at computed + 4, or computed + 1 had all been rejected.
    # Both must stay in block 1: 16 <= computed <= 28.
    assert safe({"r": computed}, {"r": 4}, {"r": 1}) is expected


def test_new_resumed_and_far_requests():
    assert safe({"a": 20, "b": 40}, {"a": 4, "b": 4}, {"a": 1, "b": 2})
    assert not safe({"a": 20, "b": 40}, {"a": 4, "b": 4}, {"a": 1})  # b has no block yet
    restarted = {"b"}  # resumed: its old block entry is stale
    assert not safe({"a": 20, "b": 40}, {"a": 4, "b": 4}, {"a": 1, "b": 2}, restarted=restarted)
    assert not safe({"a": 1}, {"a": 1}, {"a": 0})  # too close to the start to bound


def test_counts_come_from_the_previous_postprocess_in_the_new_row_order():
    num_accepted = torch.ones(6, dtype=torch.int32)
    postprocess_out = torch.tensor([4, 1, 3, 2, 9, 9], dtype=torch.int32)
    prev_positions = torch.tensor([2, 0, -1, 3], dtype=torch.int32)  # row 2 is new
    align_overlap.take_postprocess_counts(num_accepted, postprocess_out, prev_positions)
    assert num_accepted.tolist() == [3, 4, 1, 2, 1, 1]


def test_the_runner_hunks_take_vllms_path_unless_the_step_applies(patched_vllm):
    """Every use of the flag in the patched runner is guarded by it, and it is set from the
    runner_step_begins seam once per execute_model, before _prepare_inputs reads it."""
    source = (patched_vllm / "v1" / "worker" / "gpu_model_runner.py").read_text()
    ast.parse(source)
    setting = "self._hyperqwen_no_wait = seams.runner_step_begins(self, scheduler_output)"
    assert source.count(setting) == 1
    set_at = source.index(setting)
    assert set_at < source.index("self._prepare_inputs(", set_at)
    assert source.count('getattr(self, "_hyperqwen_no_wait", False)') == 1  # _prepare_inputs


def test_off_unless_the_env_says_1(monkeypatch):
    """Unset, no step applies and vLLM's runner is not even looked at; set to 1, it is."""
    from types import SimpleNamespace

    from hyperqwen.engine import seams
    from hyperqwen.engine.features import ALIGN_OVERLAP

    monkeypatch.delenv(ALIGN_OVERLAP.env, raising=False)
    assert not seams.runner_step_begins(SimpleNamespace(), None)
    monkeypatch.setenv(ALIGN_OVERLAP.env, "1")
    with pytest.raises(AttributeError, match="cache_config"):
        seams.runner_step_begins(SimpleNamespace(), None)

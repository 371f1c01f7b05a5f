"""The streaming patches of the series on the real vLLM OpenAI app (CPU): sse-keep-alive,
bench-sse-comments (`vllm bench serve`, patched and stock) and engine-stall-sentinel's knob.
The report they read is tests/api_patches_report.py's (see test_api_patches.py).
"""

from __future__ import annotations

import itertools
import json

import pytest
from api_patches_app import KEEP_ALIVE_S, KEEP_ALIVES_PER_GAP

from hyperqwen.settings import PINNED_VLLM


@pytest.fixture
def report(api_patches_report: dict) -> dict:
    """conftest's one report of the patched app, shared by the test_api_patches*.py files."""
    return api_patches_report


def _without_keep_alives(lines: list[str]) -> list[str]:
    """The stream's lines with each run of keep-alive comments collapsed to one ':'."""
    collapsed: list[str] = []
    for line in lines:
        text = ":" if line == ": keep-alive" else line
        if not (text == ":" and collapsed and collapsed[-1] == ":"):
            collapsed.append(text)
    return collapsed


def test_keep_alive_comments_fill_the_quiet_gaps_of_a_stream(report):
    gaps = report["sse"]["gaps"]
    assert gaps["status"] == 200
    assert gaps["type"].startswith("text/event-stream")
    # Comments in both quiet gaps, none between the back-to-back events 2 and 3.
    assert _without_keep_alives(gaps["lines"]) == [
        "data: 1",
        ":",
        "data: 2",
        "data: 3",
        ":",
        "data: [DONE]",
    ]
    # Each gap lasted until the reader had its keep-alives: they came without a deadline.
    first_gap = gaps["lines"][1 : gaps["lines"].index("data: 2")]
    second_gap = gaps["lines"][gaps["lines"].index("data: 3") + 1 : -1]
    assert len(first_gap) >= KEEP_ALIVES_PER_GAP and len(second_gap) >= KEEP_ALIVES_PER_GAP
    # The server's send times (its event loop's clock): a comment only after a whole interval
    # of silence, never sooner, however late the loop ran.
    sent = gaps["sent"]
    assert [body for _, body in sent] == [line + "\n\n" for line in gaps["lines"]]
    for (before, _), (at, body) in itertools.pairwise(sent):
        if body == ": keep-alive\n\n":
            assert at - before >= KEEP_ALIVE_S, (before, at)


def test_keep_alive_never_splits_an_event(report):
    lines = report["sse"]["split_event"]["lines"]
    assert lines == ['data: {"part": 1}', "data: [DONE]"]


def test_other_responses_are_untouched_by_keep_alive(report):
    assert json.loads(report["sse"]["version"]) == {"version": PINNED_VLLM}


def test_a_client_hanging_up_still_ends_the_stream(report):
    abandoned = report["sse"]["abandoned"]
    assert abandoned["lines"] == ["data: 1", ": keep-alive"]
    assert report["sse"]["abandoned_generator_closed"]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_vllm_bench_serve_parses_streams_with_keep_alives(report, endpoint):
    output = report["bench"][f"patched_{endpoint}"]
    assert output["success"], output["error"]
    assert output["text"] == "abc"
    assert output["output_tokens"] == 3
    assert output["ttft"] >= 0.25  # the first token, not the first keep-alive, stops the clock
    assert len(output["itl"]) == 2


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_stock_vllm_bench_serve_garbles_streams_with_keep_alives(report, endpoint):
    """Why bench-sse-comments.patch exists: pristine 0.26.0 glues a lone keep-alive to the
    events after it, losing tokens (and with them TTFT and ITL) or the whole request."""
    output = report["bench"][f"pristine_{endpoint}"]
    assert output["text"] != "abc"
    assert len(output["itl"]) != 2


def test_sentinel_knob_is_registered_and_kept_out_of_the_compile_key(report):
    sentinel = report["sentinel"]
    assert sentinel["default"] == 120.0
    assert sentinel["from_env"] == 7.5
    assert sentinel["registered"]
    assert not sentinel["in_compile_factors"]

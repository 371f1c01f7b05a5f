"""The request patches of the series on the real vLLM OpenAI app (CPU): request-body-limit
and unknown-model-404, plus malformed JSON, which vLLM 0.26.0 already answers with 400 (no patch
needed; checked here). The report they read is tests/api_patches_report.py's (see
test_api_patches.py).
"""

from __future__ import annotations

import pytest
from api_patches_app import BODY_LIMIT


@pytest.fixture
def report(api_patches_report: dict) -> dict:
    """conftest's one report of the patched app, shared by the test_api_patches*.py files."""
    return api_patches_report


def test_an_announced_oversized_body_is_refused_before_it_is_sent(report):
    declared = report["body"]["declared"]
    assert declared["status"] == 413  # answered though not one byte of the body was sent
    assert declared["cors"]  # answered inside CORSMiddleware
    error = declared["body"]["error"]
    assert error["code"] == 413
    assert f"larger than {BODY_LIMIT} bytes" in error["message"]
    assert "--max-request-body-bytes" in error["message"]


def test_the_limit_is_exact_and_counts_chunked_bodies(report):
    body = report["body"]
    assert body["at_limit"] == 200
    assert body["one_over_limit"] == 413
    assert body["chunked_small"] == 200
    status, answer = body["chunked_over"]
    assert status == 413
    assert answer["error"]["code"] == 413  # same JSON shape as the Content-Length path
    assert "--max-request-body-bytes" in answer["error"]["message"]


def test_both_ways_of_refusing_answer_the_same_json(report):
    # engine/body_limit.py writes the Content-Length answer itself; vLLM's exception handler
    # writes the counted one: a change to either shows here.
    body = report["body"]
    assert body["declared"]["body"] == body["chunked_over"][1]


def test_an_oversized_upload_does_not_disturb_other_requests(report):
    body = report["body"]
    assert body["during_slow_upload"] == 200
    assert body["slow_upload_unanswered_meanwhile"]  # served while the upload hung mid-body
    assert body["slow_upload"] == 413
    assert body["after"] == 200


@pytest.mark.parametrize("target", ["/v1/chat/completions", "/tokenize"])
def test_malformed_json_answers_400_with_a_message_already_in_stock_vllm(report, target):
    status, answer = report["body"][f"malformed{target}"]
    assert status == 400
    assert answer["error"]["code"] == 400
    assert "JSON decode error" in answer["error"]["message"]


@pytest.mark.parametrize(
    "case", ["tokenize_unknown", "chat_render_unknown", "completion_render_unknown"]
)
def test_unknown_model_answers_404_naming_the_served_models(report, case):
    status, answer = report["models"][case]
    assert status == 404
    assert answer["error"]["type"] == "NotFoundError"
    assert answer["error"]["param"] == "model"
    assert answer["error"]["message"] == (
        "The model `nope` does not exist. Served models: `qwen-a`, `qwen-b`."
    )


def test_known_models_still_work_and_lora_adapters_are_listed(report):
    assert report["models"]["tokenize_known"] == 200
    status, answer = report["models"]["with_lora"]
    assert status == 404
    assert answer["error"]["message"].endswith("Served models: `qwen-a`, `qwen-b`, `sql-lora`.")

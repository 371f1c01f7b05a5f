"""teacher_forcing.py on hand-made answers shaped as vLLM 0.26's /v1/completions gives them."""

from __future__ import annotations

import json

import pytest
from teacher_forcing import (
    forced_logprobs,
    logprob_differences,
    mean_and_max_abs,
    teacher_forced_request,
)

TOKENS = [11, 502, 502, 7, 90]


def entry(token: int, logprob: float, rank: int, **others: float) -> dict:
    """One position as vLLM writes it: the prompt's token plus top-k others, keyed by id."""
    out = {str(token): {"logprob": logprob, "rank": rank, "decoded_token": f"t{token}"}}
    for key, value in others.items():
        out[key.removeprefix("id")] = {"logprob": value, "rank": 1, "decoded_token": "x"}
    return out


def answer(logprobs: list[float]) -> dict:
    """A choice for TOKENS, through JSON as the client sees it (int keys become strings)."""
    entries = [None] + [
        entry(token, lp, rank=3, id999=-0.5) for token, lp in zip(TOKENS[1:], logprobs, strict=True)
    ]
    return json.loads(json.dumps({"text": "!", "prompt_logprobs": entries}))


def test_request_asks_for_the_prompts_own_logprobs_and_one_token():
    request = teacher_forced_request((1, 2))
    assert request == {"prompt": [1, 2], "max_tokens": 1, "prompt_logprobs": 0}


def test_reads_the_actual_tokens_logprob_not_the_top_ones():
    choice = answer([-1.0, -2.0, -3.0, -9999.0])
    assert forced_logprobs(choice, TOKENS, 1) == [-1.0, -2.0, -3.0, -9999.0]
    assert forced_logprobs(choice, TOKENS, 3) == [-3.0, -9999.0]


def test_differences_are_candidate_minus_reference_from_start():
    reference, candidate = answer([-1.0, -2.0, -3.0, -4.0]), answer([-1.0, -2.5, -2.75, -4.0])
    assert logprob_differences(reference, candidate, TOKENS, 2) == [-0.5, 0.25, 0.0]
    assert mean_and_max_abs([-0.5, 0.25, 0.0]) == (0.25, 0.5)


def test_refuses_the_first_position_and_misfit_answers():
    choice = answer([-1.0, -2.0, -3.0, -4.0])
    with pytest.raises(ValueError, match="first prompt token"):
        forced_logprobs(choice, TOKENS, 0)
    with pytest.raises(ValueError, match="5 prompt tokens"):
        forced_logprobs({"prompt_logprobs": choice["prompt_logprobs"][:4]}, TOKENS, 1)
    with pytest.raises(ValueError, match="None entries"):
        forced_logprobs({"text": "!"}, TOKENS, 1)
    with pytest.raises(ValueError, match="position 3: no log-probability for token 8"):
        forced_logprobs(choice, [11, 502, 502, 8, 90], 1)
    with pytest.raises(ValueError, match="no positions"):
        mean_and_max_abs([])

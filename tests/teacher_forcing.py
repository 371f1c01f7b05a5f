"""Teacher-forced comparison of two servers: each is sent the same token ids as a /v1/completions
prompt with `prompt_logprobs` and max_tokens 1, and the log-probabilities they assign to the
tokens that actually follow are compared position by position.

vLLM 0.26's answer (entrypoints/openai/completion/protocol.py, CompletionResponseChoice) puts
them in the choice's `prompt_logprobs`: one entry per prompt token, None for the first (nothing
precedes it), else a dict keyed by token id, which JSON makes a string, of
{"logprob", "rank", "decoded_token"}; the prompt's own token is always among the keys, beside
the top `prompt_logprobs` others. A -inf log-probability comes back as -9999.0
(entrypoints/generate/base/serving.py: clamp_prompt_logprobs).
"""

from __future__ import annotations

from collections.abc import Sequence


def teacher_forced_request(token_ids: Sequence[int]) -> dict:
    """The extra /v1/completions fields of a teacher-forced request for `token_ids` (the
    prompt): its own tokens' log-probabilities, one generated token that nobody reads."""
    return {"prompt": list(token_ids), "max_tokens": 1, "prompt_logprobs": 0}


def forced_logprobs(choice: dict, token_ids: Sequence[int], start: int) -> list[float]:
    """The log-probability `choice` (an answer to teacher_forced_request(token_ids)) gives each
    token of `token_ids[start:]` after the tokens before it. `start` >= 1: the first token has
    no prediction."""
    if start < 1:
        raise ValueError(f"start={start}: the first prompt token has no log-probability")
    entries = choice.get("prompt_logprobs")
    if entries is None or len(entries) != len(token_ids):
        got = None if entries is None else len(entries)
        raise ValueError(f"prompt_logprobs has {got} entries for {len(token_ids)} prompt tokens")
    logprobs = []
    for position in range(start, len(token_ids)):
        entry, token = entries[position], token_ids[position]
        if entry is None or str(token) not in entry:
            raise ValueError(f"position {position}: no log-probability for token {token}")
        logprobs.append(float(entry[str(token)]["logprob"]))
    return logprobs


def logprob_differences(
    reference: dict, candidate: dict, token_ids: Sequence[int], start: int
) -> list[float]:
    """candidate's minus reference's log-probability of each token of token_ids[start:]."""
    want = forced_logprobs(reference, token_ids, start)
    got = forced_logprobs(candidate, token_ids, start)
    return [g - w for w, g in zip(want, got, strict=True)]


def mean_and_max_abs(differences: Sequence[float]) -> tuple[float, float]:
    if not differences:
        raise ValueError("no positions to compare")
    magnitudes = [abs(d) for d in differences]
    return sum(magnitudes) / len(magnitudes), max(magnitudes)

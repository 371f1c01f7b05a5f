"""DRAFT_HEAD_INT8's engine side on the CPU: its variable, and a drafter it cannot serve.

The install into vLLM's real Qwen3_5MTP (drafts against the bf16 rows') is in
tests/test_synth.py, the kernel in tests/test_kernel_draft_argmax.py, the served greedy output
in tests/test_engine_draft_vocab_gpu.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hyperqwen.engine import draft_head_int8
from hyperqwen.engine.features import DRAFT_HEAD_INT8, FeatureSwitchError, env_value


def test_variable_is_off_unset_and_refuses_other_words(monkeypatch):
    monkeypatch.delenv(DRAFT_HEAD_INT8.env, raising=False)
    assert env_value(DRAFT_HEAD_INT8) == "0"
    monkeypatch.setenv(DRAFT_HEAD_INT8.env, "true")
    with pytest.raises(FeatureSwitchError, match=f"{DRAFT_HEAD_INT8.env}='true': expected one of"):
        env_value(DRAFT_HEAD_INT8)


def test_a_drafter_without_the_draft_vocabulary_keeps_vllms_path(engine_log):
    drafter = SimpleNamespace(get_top_tokens="vLLM's")
    proposer = SimpleNamespace(model=drafter, vllm_config=None)
    assert not draft_head_int8.install(proposer)
    assert drafter.get_top_tokens == "vLLM's"
    assert "has no draft vocabulary" in engine_log.text


def test_hyperqwen_serve_asks_before_vllm_starts_only_where_the_variable_is_set(tmp_path):
    from hyperqwen.engine.features import serve_refusal
    from hyperqwen.settings import Settings

    def settings(**values):
        return Settings.model_validate({"DRAFT_HEAD_INT8": "1", **values})

    refused = serve_refusal(settings(), "single", [], tmp_path)  # a folder without the head
    assert refused and "does not exist" in refused
    # where it cannot apply it only warns (DRAFT_VOCAB=off, SPEC=ngram), and batch never drafts
    assert serve_refusal(settings(DRAFT_VOCAB="off"), "single", [], tmp_path) is None
    assert serve_refusal(settings(SPEC="ngram"), "single", [], tmp_path) is None
    assert serve_refusal(settings(), "batch", [], tmp_path) is None

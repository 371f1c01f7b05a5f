"""`bench draft-replay`: measured greedy answers replayed through drafting policies."""

import json

import numpy as np
import pytest
from cli_runner import run_in_process

from hyperqwen.bench.draft_replay import figures, policy, replay
from hyperqwen.bench.quoting_ceiling_result import CEILING_KIND, CEILING_SCHEMA
from hyperqwen.bench.quoting_result import DecodeCounts
from hyperqwen.bench.quoting_run import MEASUREMENTS_KIND, MEASUREMENTS_SCHEMA
from hyperqwen.bench.quoting_tasks import COPY_KINDS, KINDS
from hyperqwen.checkpoint.tokenizer import write_tokenizer_files

PROMPT = list(range(100, 120))
ANSWER = list(range(10))


def oracle(width: int):
    """Proposes the answer's next `width` tokens (as far as it goes) after a context of PROMPT
    and part of ANSWER."""
    return lambda context: ANSWER[len(context) - len(PROMPT) :][:width]


def test_a_step_accepts_the_agreeing_prefix_and_makes_one_token_more() -> None:
    # 10 tokens: the prefill's, then steps at 1 (accepts 1-3, makes 4), 5 (5-7, 8), 9 (9, then
    # the end): 3 steps, 7 drafts accepted, 10 decode tokens (the end included)
    assert replay(PROMPT, ANSWER, oracle(3)) == DecodeCounts(
        decode_tokens=10, accepted=7, drafting_steps=3
    )
    assert replay(PROMPT, ANSWER, lambda context: []) == DecodeCounts(10, 0, 0)
    wrong = replay(PROMPT, ANSWER, lambda context: [-5, 1, 2])  # its first draft never agrees
    assert wrong == DecodeCounts(decode_tokens=10, accepted=0, drafting_steps=10)
    assert wrong.steps == 10
    assert figures(replay(PROMPT, ANSWER, oracle(3))) == {
        "steps": 3, "drafting_steps_pct": 100.0, "tokens_per_any_step": 3.33,
        "tokens_per_drafting_step": 3.33,
    }  # fmt: skip


def test_the_policies_are_lookups_and_vllms_search_at_their_widths() -> None:
    text = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24]
    context = [1, *text, 2, *text[:6]]  # the last 6 tokens repeat: a long match
    tokens = np.asarray(context, dtype=np.int64)
    assert list(policy("lookup-k15")(tokens)) == [*text[6:], 2, *text[:2]]  # on past the copy
    assert list(policy("lookup-k8")(tokens)) == text[6:14]
    assert list(policy("ngram-k4")(tokens)) == text[6:10]
    short = np.asarray([1, 5, 6, 7, 2, 5, 6, 7], dtype=np.int64)  # a 3-token match
    assert list(policy("lookup-k15")(short)) == ([2, 5, 6, 7] * 4)[:15]  # all 15, periodic
    for word in ("lookup-k0", "ngram-k32", "mtp-k3", "lookup"):
        with pytest.raises(ValueError, match=word):
            policy(word)


def measurements(tmp_path, prompts: dict | None) -> str:
    """One configuration's answers: the copy kinds repeat their prompt's passage, chat says
    something new."""
    passage = (
        "The quick brown fox jumps over the lazy dog, then naps under the old oak tree. Later "
        "that evening a small grey owl lands on a branch above it and watches the river run "
        "past the mill, where the miller counts his sacks of flour by lantern light."
    )
    texts = {kind: [f"Repeat this:\n\n{passage}"] for kind in COPY_KINDS}
    texts["chat"] = ["Tell me about the weather."]
    answers = {kind: passage for kind in COPY_KINDS} | {"chat": "It is sunny and warm today."}
    row = {"tokens_per_step": None}
    passes = [{kind: {"row": row, "texts": [answers[kind]]} for kind in KINDS}]
    document = {
        "schema": MEASUREMENTS_SCHEMA, "kind": MEASUREMENTS_KIND, "command": "bench quoting",
        "plan": {"seed": 0}, "prompts": {"texts": texts} if prompts is None else prompts,
        "configs": {"hyperqwen-off": {"baseline": None, "passes": passes}},
    }  # fmt: skip
    path = tmp_path / "m.json"
    path.write_text(json.dumps(document))
    return str(path)


def ceiling(tmp_path) -> str:
    configs = {name: {"passes": [{"refused": None, "step_ms": [ms, ms]}]}
               for name, ms in (("k0", 10.0), ("k15", 15.0))}  # fmt: skip
    document = {"schema": CEILING_SCHEMA, "kind": CEILING_KIND, "command": "bench quoting-ceiling",
                "plan": {}, "configs": configs}  # fmt: skip
    path = tmp_path / "ceiling.json"
    path.write_text(json.dumps(document))
    return str(path)


def test_the_command_replays_a_runs_answers_and_projects(tmp_path, capsys) -> None:
    tokenizer = tmp_path / "tokenizer"
    write_tokenizer_files(tokenizer, model_max_length=4096)
    out = tmp_path / "replay.json"
    argv = [measurements(tmp_path, None), "--tokenizer", str(tokenizer), "--policies",
            "lookup-k15,ngram-k4", "--ceiling", ceiling(tmp_path), "--out", str(out)]  # fmt: skip
    assert run_in_process("bench", "draft-replay", *argv) == 0, capsys.readouterr().err
    assert "tokens_per_drafting_step" not in capsys.readouterr().out  # a table, not JSON
    table = json.loads(out.read_text())["policies"]
    for kind in COPY_KINDS:  # the answer copies the prompt: drafted and accepted
        copied = table["lookup-k15"][kind]
        assert copied["tokens_per_any_step"] > 6 and copied["drafting_steps_pct"] > 50
        share = copied["drafting_steps_pct"] / 100
        step_ms = share * 15 + (1 - share) * 10  # k15's and k0's steps
        projected = round(1000 * copied["tokens_per_any_step"] / step_ms, 1)
        assert copied["projected_27b_tok_s"] == projected
        assert table["ngram-k4"][kind]["projected_27b_tok_s"] is None  # no k4 step measured
        # every step at k0's time: the most any width could make
        at_most = table["ngram-k4"][kind]["bound_27b_tok_s"]
        assert at_most == round(1000 * table["ngram-k4"][kind]["tokens_per_any_step"] / 10, 1)
        assert copied["bound_27b_tok_s"] > copied["projected_27b_tok_s"]
        assert table["ngram-k4"][kind]["tokens_per_any_step"] <= 5
    assert table["lookup-k15"]["chat"]["tokens_per_any_step"] < 1.5  # nothing to copy

    no_texts = measurements(tmp_path, {"fingerprint": "x"})
    assert run_in_process("bench", "draft-replay", no_texts, "--tokenizer", str(tokenizer)) == 2
    assert "keep no prompt texts" in capsys.readouterr().err
    bad = [argv[0], "--tokenizer", str(tokenizer), "--policies", "eagle-k3"]
    assert run_in_process("bench", "draft-replay", *bad) == 2
    assert "'eagle-k3': give lookup-kK or ngram-kK" in capsys.readouterr().err

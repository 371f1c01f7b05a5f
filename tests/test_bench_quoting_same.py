"""`hyperqwen bench quoting-same`: answers of two runs' configurations counted alike or not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_runner import run_in_process

from hyperqwen.bench.quoting_result import ResultFileError
from hyperqwen.bench.quoting_run import MEASUREMENTS_KIND
from hyperqwen.bench.quoting_same import compare, parse_side

PROMPTS = {"fingerprint": "0123456789abcdef", "python": "3.12.3"}


def run(configs: dict[str, list[dict[str, list[str]]]], prompts: dict = PROMPTS) -> dict:
    """A measurements document: per configuration, per pass, each kind's answers."""
    return {
        "kind": MEASUREMENTS_KIND,
        "prompts": prompts,
        "configs": {
            name: {
                "passes": [
                    {kind: {"texts": texts} for kind, texts in one.items()} for one in passes
                ]
            }
            for name, passes in configs.items()
        },
    }


def test_counts_identical_answers_per_kind_and_where_the_rest_part() -> None:
    reference = run({"off": [{"quote": ["abc", "hello"], "chat": ["x"]}] * 2})
    other = run(
        {
            "off": [
                {"quote": ["abc", "help!"], "chat": ["x"]},
                {"quote": ["zzz", "hello"], "chat": ["x"]},
            ]
        }
    )
    rows = compare(("a.json", reference, "off"), ("b.json", other, "off"))
    assert rows == [
        {"kind": "quote", "requests": 4, "identical": 2, "median_first_difference": 1.5},
        {"kind": "chat", "requests": 2, "identical": 2, "median_first_difference": None},
    ]


def test_refuses_other_prompts_other_passes_and_absent_configurations() -> None:
    reference = run({"off": [{"chat": ["x"]}]})
    with pytest.raises(ResultFileError, match="prompts differ"):
        compare(
            ("a", reference, "off"), ("b", run({"off": [{"chat": ["x"]}]}, {"other": 1}), "off")
        )
    with pytest.raises(ResultFileError, match="number of passes"):
        compare(("a", reference, "off"), ("b", run({"off": [{"chat": ["x"]}] * 2}), "off"))
    with pytest.raises(ResultFileError, match=r"no configuration lookup \(it has off\)"):
        compare(("a", reference, "off"), ("b", reference, "lookup"))
    with pytest.raises(ResultFileError, match="not a `hyperqwen bench quoting`"):
        compare(("a", reference, "off"), ("b", {**reference, "kind": "other"}, "off"))
    with pytest.raises(ResultFileError, match="FILE:CONFIG"):
        parse_side("quoting-j.json")
    assert parse_side("c:/runs/q.json:hyperqwen-off") == (Path("c:/runs/q.json"), "hyperqwen-off")


def test_cli_prints_the_counts_and_refuses_bad_input_by_exit_code(tmp_path, capsys) -> None:
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(json.dumps(run({"off": [{"code": ["same", "one"]}]})))
    second.write_text(json.dumps(run({"off": [{"code": ["same", "two"]}], "ngram": []})))
    assert run_in_process("bench", "quoting-same", f"{first}:off", f"{second}:off") == 0
    out = capsys.readouterr().out
    assert f"{second}:off" in out
    assert "code         1 of 2     0" in out
    assert run_in_process("bench", "quoting-same", f"{first}:off", f"{second}:lookup") == 2
    assert "no configuration lookup (it has off, ngram)" in capsys.readouterr().err

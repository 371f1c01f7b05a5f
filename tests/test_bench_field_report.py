"""The field-report issue form: a valid GitHub issue form asking for every comparability fact."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from hyperqwen.bench.client import BenchClient
from hyperqwen.bench.header import collect_header
from hyperqwen.settings import load_settings

FORM = Path(__file__).resolve().parents[1] / ".github" / "ISSUE_TEMPLATE" / "field-report.yml"
FACTS = ("card", "power_cap", "driver", "os", "commit", "setup")
INPUT_TYPES = {"input", "textarea", "dropdown", "checkboxes"}


def load_form() -> dict:
    return yaml.safe_load(FORM.read_text(encoding="utf-8"))


def fields_by_id(form: dict) -> dict[str, dict]:
    return {item["id"]: item for item in form["body"] if item["type"] in INPUT_TYPES}


def test_form_has_the_shape_github_requires() -> None:
    form = load_form()
    assert form["name"] and form["description"] and isinstance(form["body"], list)
    ids = [item["id"] for item in form["body"] if "id" in item]
    assert len(ids) == len(set(ids)), "ids must be unique"
    for item in form["body"]:
        assert item["type"] in INPUT_TYPES | {"markdown"}
        if item["type"] == "markdown":
            assert item["attributes"]["value"].strip()
        else:
            assert re.fullmatch(r"[A-Za-z0-9_-]+", item["id"])
            assert item["attributes"]["label"].strip()


def test_form_requires_the_six_facts_and_the_row_lines() -> None:
    fields = fields_by_id(load_form())
    for fact in (*FACTS, "rows"):
        assert fact in fields, f"the form lacks {fact}"
        assert fields[fact]["validations"]["required"] is True, f"{fact} must be required"
    assert fields["rows"]["type"] == "textarea"
    assert fields["rows"]["attributes"]["render"] == "text"  # ROW lines stay one per line


def test_header_lines_the_form_points_to_are_ones_the_bench_prints() -> None:
    form_text = FORM.read_text(encoding="utf-8")
    referenced = set(re.findall(r"`# (\w+):`", form_text))
    assert {"gpu", "power_limit", "driver", "os", "commit", "settings"} <= referenced
    # No server at port 1: the header still has every key, with the version "not measured".
    header = collect_header(BenchClient("http://127.0.0.1:1", None), load_settings({}), None, {})
    assert referenced <= set(header)
    assert str(header["vllm"]).startswith("not measured")

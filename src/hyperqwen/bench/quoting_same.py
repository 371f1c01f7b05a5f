"""`hyperqwen bench quoting-same`: do two `bench quoting` runs' configurations answer alike?

quoting-result compares each configuration with its baseline inside one merged run; a question
such as "does this server under other flags still answer what it answered before" spans two
runs of the same prompts (same seed and Python), each holding a configuration of the same
name. This counts, per kind over every pass, the answers equal to the reference's and where
the others part (the first differing character).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from hyperqwen.bench.quoting_result import ResultFileError, load_measurements, mismatches
from hyperqwen.bench.quoting_run import MEASUREMENTS_KIND
from hyperqwen.exit_codes import EXIT_BAD_INPUT


def parse_side(text: str) -> tuple[Path, str]:
    """FILE:CONFIG (the file a `bench quoting` measurements file)."""
    path, colon, config = text.rpartition(":")
    if not colon or not path or not config:
        raise ResultFileError(f"{text!r}: write FILE:CONFIG, e.g. quoting-j.json:hyperqwen-off")
    return Path(path), config


def record_of(source: str, document: dict, config: str) -> dict:
    if document.get("kind") != MEASUREMENTS_KIND:
        raise ResultFileError(f"{source}: not a `hyperqwen bench quoting` measurements file")
    if config not in document["configs"]:
        measured = ", ".join(document["configs"]) or "none"
        raise ResultFileError(f"{source}: no configuration {config} (it has {measured})")
    return document["configs"][config]


def compare(reference: tuple[str, dict, str], other: tuple[str, dict, str]) -> list[dict]:
    """One row per kind: requests, how many answer as the reference, the median offset where
    the rest part. Refuses runs of different prompts or passes, which no count could compare."""
    (ref_source, ref_document, ref_config), (source, document, config) = reference, other
    if document["prompts"] != ref_document["prompts"]:
        raise ResultFileError(
            f"{source}: its prompts differ from {ref_source}'s; compare runs of the same --seed "
            "and --requests on the same Python"
        )
    ours, theirs = (
        record_of(source, document, config),
        record_of(ref_source, ref_document, ref_config),
    )
    if len(ours["passes"]) != len(theirs["passes"]):
        raise ResultFileError(f"{source}: {config} ran another number of passes than {ref_config}")
    rows = []
    for kind in ours["passes"][0]:
        requests = sum(len(kinds[kind]["texts"]) for kinds in ours["passes"])
        differ = mismatches(ours, theirs, kind)
        offsets = [found["offset"] for found in differ]
        rows.append(
            {
                "kind": kind,
                "requests": requests,
                "identical": requests - len(differ),
                "median_first_difference": statistics.median(offsets) if offsets else None,
            }
        )
    return rows


def cmd_quoting_same(args: argparse.Namespace) -> int:
    try:
        sides = [parse_side(text) for text in [args.reference, *args.others]]
        loaded = load_measurements([path for path, _ in sides])
        reference = (*loaded[0], sides[0][1])
        tables = [
            (f"{source}:{config}", compare(reference, (source, document, config)))
            for (source, document), (_, config) in zip(loaded[1:], sides[1:], strict=True)
        ]
    except ResultFileError as error:
        print(f"hyperqwen bench quoting-same: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"reference: {args.reference}")
    for name, rows in tables:
        print(f"{name}")
        print(f"  {'kind':<8} {'identical':>12}  median first difference (chars)")
        for row in rows:
            offset = row["median_first_difference"]
            shown = "-" if offset is None else f"{offset:g}"
            print(f"  {row['kind']:<8} {row['identical']:>5} of {row['requests']:<4}  {shown}")
    return 0


def add_parser(actions: argparse._SubParsersAction) -> None:
    parser = actions.add_parser(
        "quoting-same",
        help="count the answers two `bench quoting` runs' configurations share",
        description="Compare configurations of `hyperqwen bench quoting` runs of the same "
        "prompts (same --seed and --requests on the same Python) request by request: per "
        "kind, how many answers equal the reference's and the median character where the "
        "others first differ. For questions across runs, e.g. whether a build answers under "
        "other flags what it answered before: quoting-same a.json:hyperqwen-off "
        "b.json:hyperqwen-off.",
    )
    parser.add_argument("reference", metavar="FILE:CONFIG", help="the answers to compare with")
    parser.add_argument("others", nargs="+", metavar="FILE:CONFIG", help="answers to count")
    parser.set_defaults(func=cmd_quoting_same)

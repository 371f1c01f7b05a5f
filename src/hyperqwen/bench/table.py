"""`hyperqwen bench table`: chosen rows of several result files side by side.

A `bench ab` run per variant against one stock half (bench/gpu-host/ab_together.sh writes
v1.json, v2.json, ...) is read as one table: a line per row, the stock value once (from the first
file that has it) and each file's patched value with its ratio. Rows are chosen by shell-style
patterns on their names; a stock value that differs between the files is shown per file, so a
table never hides that the files were not measured against one stock half.
"""

from __future__ import annotations

import argparse
import fnmatch
import sys
from pathlib import Path

from hyperqwen.bench.results import ComparisonRow, ResultFileError, aligned, load_result
from hyperqwen.exit_codes import EXIT_BAD_INPUT

DEFAULT_ROWS = (
    "c1_decode",
    "c1_tpot",
    "c1_tokens_per_step",
    "step_gpu_ms",
    "step_gpu_busy_ms",
    "step_graph_idle_ms",
    "step_host_gap_ms",
    "c1_host_cpu_share_of_step",
)
MISSING = "-"


def chosen_rows(rows_by_file: list[list[ComparisonRow]], patterns: list[str]) -> list[str]:
    """The row names any file has that match a pattern, in the patterns' order, then each
    file's order."""
    names: list[str] = []
    for pattern in patterns:
        for rows in rows_by_file:
            for row in rows:
                if fnmatch.fnmatchcase(row.name, pattern) and row.name not in names:
                    names.append(row.name)
    return names


def _number(value: float | None) -> str:
    return MISSING if value is None else f"{value:g}"


def table_lines(labels: list[str], rows_by_file: list[list[ComparisonRow]], names: list[str]):
    """The table as aligned text lines: row, unit, stock, then per file patched (ratio)."""
    by_file = [{row.name: row for row in rows} for rows in rows_by_file]
    header = ("row", "unit", "stock", *labels)
    lines = [header]
    for name in names:
        present = [rows[name] for rows in by_file if name in rows]
        stocks = {row.stock for row in present}
        cells = []
        for rows in by_file:
            row = rows.get(name)
            if row is None:
                cells.append(MISSING)
                continue
            shown = f"{_number(row.patched)} ({_number(row.ratio)}x)"
            # another stock value than the first file's: say it beside this file's figure
            if len(stocks) > 1:
                shown += f" vs stock {_number(row.stock)}"
            cells.append(shown)
        stock = _number(present[0].stock) if len(stocks) == 1 else "differs"
        lines.append((name, present[0].unit, stock, *cells))
    return aligned(lines)


def cmd_table(args: argparse.Namespace) -> int:
    labels = args.labels.split(",") if args.labels else [Path(p).stem for p in args.files]
    if len(labels) != len(args.files):
        print(
            f"bench table: --labels names {len(labels)} files, {len(args.files)} given",
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT
    try:
        rows_by_file = [load_result(Path(path))[1] for path in args.files]
    except ResultFileError as error:
        print(f"bench table: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    patterns = args.rows or list(DEFAULT_ROWS)
    names = chosen_rows(rows_by_file, patterns)
    if not names:
        print(f"bench table: no row matches {' '.join(patterns)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print("\n".join(table_lines(labels, rows_by_file, names)))
    return 0


DESCRIPTION = f"""\
Print chosen rows of several result files (docs/results schema: `bench ab`, `bench kernels`,
`bench stepmap` ...) side by side: one line per row with its unit, the stock value, and each
file's patched value with its ratio to stock. Meant for the variants of one run against one
stock half (ab_together.sh's v1.json, v2.json ...); where the files' stock values differ, the
stock column says so and each file shows its own.

Examples:
  hyperqwen bench table /tmp/hq/feat/v*.json
  hyperqwen bench table v1.json v2.json --labels base,twin --rows 'c1_*' 'step_gpu*'

Rows: shell-style patterns on row names (default: {" ".join(DEFAULT_ROWS)}).
Exit codes: 0 printed, 2 a file unreadable or no row matched."""


def add_subcommand(actions) -> None:
    parser = actions.add_parser(
        "table",
        help="chosen rows of several result files side by side",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("files", nargs="+", metavar="RESULT.json")
    parser.add_argument(
        "--rows", nargs="+", metavar="PATTERN", help="row name patterns (default: above)"
    )
    parser.add_argument(
        "--labels", metavar="A,B,...", help="column names, one per file (default: file stems)"
    )
    parser.set_defaults(func=cmd_table)

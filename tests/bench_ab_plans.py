"""The plan helpers and notes the `hyperqwen bench ab` argv and run tests share."""

from __future__ import annotations

from hyperqwen.bench.ab_argv import serve_argv, settled_stock_spec
from hyperqwen.bench.ab_plan import SIDES, ABPlan

RATES = "0.77,0.55,0.40"
SAME_SPEC_NOTE = (
    "The stock side speculates with the patched side's --speculative-config (same method, "
    "drafts, acceptance): the ratios are against stock with the same speculation."
)
NO_STOCK_SPEC_NOTE = (
    "The stock side runs without speculation (--stock-spec none), the patched side "
    "speculates: these ratios include speculation's gain."
)


def planned(argv: list[str]) -> ABPlan:
    """The plan of `hyperqwen bench ARGV` as the real parser reads it."""
    from hyperqwen.cli import build_parser

    return ABPlan.from_args(build_parser().parse_args(["bench", *argv]))


def parsed(argv: list[str]) -> ABPlan:
    """planned(argv) with --stock-spec settled."""
    return settled_stock_spec(planned(argv))


def sides_argv(plan: ABPlan) -> dict[str, list[str]]:
    return {side: serve_argv(side, plan, 8000) for side in SIDES}

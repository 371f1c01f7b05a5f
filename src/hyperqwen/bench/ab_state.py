"""`bench ab`'s state file: the stock half that --phase stock measured, carried to --phase
patched, which must run with the same PLAN_OPTIONS."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from pathlib import Path

from hyperqwen.bench.ab_plan import PLAN_OPTIONS, ABError, SideResult, jsonable
from hyperqwen.bench.options import DATE_FORMAT

STATE_SCHEMA = 1
# Options newer than some saved stock halves, with the value those halves were measured with.
OPTIONS_ADDED_LATER = {"sharegpt": False, "depths": [], "synthetic_acceptance_rest": None}


def new_state(plan: dict) -> dict:
    """A state before any half is measured; its date is the run's start."""
    return {"schema": STATE_SCHEMA, "date": time.strftime(DATE_FORMAT), "plan": plan, "stock": None}


def with_side(state: dict, result: SideResult) -> dict:
    return {**state, result.side: jsonable(asdict(result))}


def load_state(path: Path, plan: dict) -> dict:
    """The saved state of --phase stock, checked against this run's options (`plan`:
    ABPlan.recorded())."""
    if not path.is_file():
        raise ABError(f"--state {path}: no such file; run --phase stock first (same options)")
    state = json.loads(path.read_text(encoding="utf-8"))
    if state.get("schema") != STATE_SCHEMA or not state.get("stock"):
        raise ABError(f"--state {path}: holds no stock half; run --phase stock first")
    then = {name: state["plan"].get(name, OPTIONS_ADDED_LATER.get(name)) for name in PLAN_OPTIONS}
    differing = [name for name in PLAN_OPTIONS if then[name] != plan[name]]
    if differing:
        shown = "; ".join(f"{name}: {then[name]!r} then, {plan[name]!r} now" for name in differing)
        raise ABError(
            f"--state {path} was measured with other options ({shown}). Pass the same options "
            "as --phase stock did, or measure the stock half again"
        )
    return state


def save_state(path: Path, state: dict) -> None:
    """Written whole or not at all: patched runs started beside the stock run read it as soon
    as it appears, and several of them may save theirs into one file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    partial.write_text(json.dumps(state, indent=2) + "\n", encoding="utf-8")
    os.replace(partial, path)

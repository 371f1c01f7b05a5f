"""`bench ab`'s plan: the options of one comparison, fixed once read, and what a side measured.

ABPlan is frozen: settling a default (--stock-spec, --cohorts) makes a new plan, so every step
after reads the same options. PLAN_OPTIONS are the ones that define the comparison; both
phases must agree on each, and the state and result files keep them.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import ClassVar

from hyperqwen.bench.rows import Row
from hyperqwen.checkpoint.geometry import text_config
from hyperqwen.settings import Mode

SIDES = ("stock", "patched")
PHASES = ("stock", "patched", "both")
STOCK_SPECS = ("same", "none")
DEFAULT_SERVER_COMMAND = "{python} -m vllm.entrypoints.cli.main {args}"
# The options that define a comparison: both phases must agree on every one.
PLAN_OPTIONS = (
    "model",
    "stock_model",
    "mode",
    "env_file",
    "input_len",
    "output_len",
    "cohorts",
    "rounds",
    "prefill",
    "prefill_requests",
    "depths",
    "system_prompt",
    "copy",
    "sharegpt",
    "temperature",
    "seed",
    "synthetic_acceptance",
    "synthetic_acceptance_rest",
    "vllm_args",
    "stock_args",
    "stock_spec",
    "server_command",
    "quality",
    "profile_steps",
    "profile_cohort",
)


class ABError(Exception):
    """The comparison cannot go on; the message names the option or file and the fix."""


@dataclass(frozen=True)
class ABPlan:
    """Every option of one `bench ab` run, PLAN_OPTIONS first, in their order."""

    model: str
    """MODEL_DIR, resolved."""
    stock_model: str | None
    mode: Mode
    env_file: str | None
    input_len: int
    output_len: int
    cohorts: tuple[int, ...] | None
    """None until settled (ab_argv.settled_cohorts)."""
    rounds: int
    prefill: tuple[int, ...]
    prefill_requests: int
    depths: tuple[int, ...]
    system_prompt: int
    copy: bool
    sharegpt: bool
    temperature: float
    seed: int
    synthetic_acceptance: tuple[float, ...] | None
    synthetic_acceptance_rest: float | None
    """The rate of every drafted position past synthetic_acceptance's (None: refused)."""
    vllm_args: str
    stock_args: str
    stock_spec: str | None
    """None until settled (ab_argv.settled_stock_spec)."""
    server_command: str
    quality: str | None
    profile_steps: int
    profile_cohort: int
    """The concurrent requests of the profiled window (1: one C1 request)."""
    phase: str
    stock_vllm: str | None
    patched_vllm: str | None
    workdir: Path
    state: Path
    out: Path
    port: int
    startup_timeout: float
    timeout: float
    turn_lock: str | None
    # `bench run`'s workload options that bench ab fixes: every prompt salted, none shared.
    shared: ClassVar[bool] = False

    @property
    def random_tokens(self) -> bool:
        """Random-token rows only, as dummy weights need (the default, without --sharegpt)."""
        return not self.sharegpt

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ABPlan:
        """The plan of parsed `bench ab` options: paths resolved, the state and result files
        defaulting into --workdir."""
        values = {item.name: getattr(args, item.name) for item in fields(cls)}
        workdir = Path(args.workdir)
        return cls(
            **{
                **values,
                "model": str(Path(args.model).resolve()),
                "stock_model": str(Path(args.stock_model).resolve()) if args.stock_model else None,
                "workdir": workdir,
                "state": Path(args.state) if args.state else workdir / "ab-state.json",
                "out": Path(args.out) if args.out else workdir / "ab-result.json",
            }
        )

    def vllm_parent(self, side: str) -> str | None:
        """--stock-vllm or --patched-vllm."""
        return self.stock_vllm if side == "stock" else self.patched_vllm

    def recorded(self) -> dict:
        """PLAN_OPTIONS as the state and result files keep them (JSON: tuples become lists)."""
        return jsonable({name: getattr(self, name) for name in PLAN_OPTIONS})


def jsonable(value):
    return json.loads(json.dumps(value, default=list))


@dataclass(frozen=True)
class SideResult:
    """One measured server: how it was started, how long it took, what it did."""

    side: str
    vllm_parent: str
    command: list[str]
    patches: str
    version: str
    startup_s: float
    weight_gib: float | None
    rows: list[Row]
    log: str
    quality: dict | None = None  # the `bench quality` document, with --quality
    profile: dict | None = None  # GPU time per decode step (bench/profile.py), --profile-steps
    # the server processes' host CPU over a few C1 requests (bench/host_cpu.py), with a profile
    host_cpu: dict | None = None
    # The profile's knobs taken from the environment (patched side), part of the command.
    knobs: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_json(cls, values: dict) -> SideResult:
        return cls(**{**values, "rows": [Row(**row) for row in values["rows"]]})


# config.json keys that may differ between a base and its prepared copy (the same model).
PREPARED_KEYS = frozenset({"quantization_config"})


def check_same_model(model: Path, stock_model: Path) -> None:
    """--stock-model must be the same model as MODEL_DIR, only its weight format may differ."""
    if not (stock_model / "config.json").is_file():
        raise ABError(f"--stock-model {stock_model}: no config.json; give a model folder")
    configs = [
        json.loads((folder / "config.json").read_text(encoding="utf-8"))
        for folder in (model, stock_model)
    ]

    first, second = (
        {key: value for key, value in text_config(config).items() if key not in PREPARED_KEYS}
        for config in configs
    )
    differing = sorted(
        key for key in first.keys() | second.keys() if first.get(key) != second.get(key)
    )
    if differing or configs[0].get("architectures") != configs[1].get("architectures"):
        shown = (
            ", ".join(f"{key} {first.get(key)!r} vs {second.get(key)!r}" for key in differing[:4])
            or "architectures"
        )
        raise ABError(
            f"--stock-model {stock_model} is not the model in {model} ({shown}); give the base "
            "MODEL_DIR was prepared from, so both sides serve the same model"
        )

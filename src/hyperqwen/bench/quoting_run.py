"""`bench quoting`'s measuring: each configuration's server, started here one after another
(server_process) or given by URL, answers every task of every kind at C1, in passes.

Per server: one warm-up request per kind (thrown away: graph capture, first-use compilation),
then each pass sends every kind's tasks one at a time (C1), reading vLLM's counters before and
after each kind, so its tokens_per_step belongs to it alone. A pass is a `bench run` row per
kind (rows.summarize) plus every answer's text, which the result compares with the baseline's,
and the kind's counters and output tokens, which count every decode step.
The measurements file is written after every configuration, so a run that fails late keeps
what it measured; several files (one per GPU command) merge into one result.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from hyperqwen.bench.ab_argv import server_command
from hyperqwen.bench.ab_plan import ABError
from hyperqwen.bench.ab_run import check_vllm_tree, pin_needed, pins_kv_pool
from hyperqwen.bench.client import BenchClient, ServerCounters
from hyperqwen.bench.header import git_commit, gpu_facts, server_version
from hyperqwen.bench.host_cpu import host_cpu_while
from hyperqwen.bench.host_stacks import stack_lines, steps_sampled
from hyperqwen.bench.options import DATE_FORMAT
from hyperqwen.bench.quoting_configs import ServerConfig
from hyperqwen.bench.quoting_tasks import Task, check_fit
from hyperqwen.bench.rows import Row, format_row, summarize
from hyperqwen.bench.run import run_pass, served_model
from hyperqwen.bench.server_process import (
    SERVER_HOST,
    HealthyServer,
    ServerStartError,
    all_running,
    free_port,
    running_server,
)

MEASUREMENTS_SCHEMA = 1
MEASUREMENTS_KIND = "bench quoting measurements"
WARM_UP = "warm-up"
# --host-stacks samples a pass of this kind (salted apart from the measured passes)
HOST_STACKS_KIND = "quote"
HOST_STACKS_SALT = "host-stacks"


@dataclass(frozen=True)
class ServerStart:
    """How a benchmark starts its servers and reaches them: the part of its plan that
    launching reads (`bench quoting`'s, `bench quoting-ceiling`'s, `bench needle`'s)."""

    model: str | None
    """MODEL_DIR, resolved; None when every server is given by --url."""
    vllm_args: str
    stock_vllm: str | None
    patched_vllm: str | None
    env_file: str | None
    server_command: str
    startup_timeout: float
    timeout: float
    start_together: bool
    workdir: Path


def server_start(args: Any, vllm_args: str | None = None) -> ServerStart:
    """The ServerStart of a benchmark's parsed options (add_server_start_options,
    add_run_files_options); a tree or --env-file option the benchmark lacks is None, and
    vllm_args replaces --vllm-args where the benchmark adds its own flags."""
    return ServerStart(
        model=str(Path(args.model).resolve()) if args.model else None,
        vllm_args=args.vllm_args if vllm_args is None else vllm_args,
        stock_vllm=getattr(args, "stock_vllm", None),
        patched_vllm=getattr(args, "patched_vllm", None),
        env_file=getattr(args, "env_file", None),
        server_command=args.server_command,
        startup_timeout=args.startup_timeout,
        timeout=args.timeout,
        start_together=args.start_together,
        workdir=Path(args.workdir),
    )


class ConfigsPlan(Protocol):
    """What run_configs reads of a plan that measures server configurations in turn (`bench
    quoting`'s and `bench needle`'s)."""

    configs: tuple[ServerConfig, ...]
    urls: dict[str, str]
    start: ServerStart
    out: Path


# What a benchmark measures on one healthy server: its part of the configuration's record
# (given the server's process id where this run started it, None for a --url server).
Measure = Callable[[BenchClient, int | None], dict]


@dataclass(frozen=True)
class QuotingPlan:
    """The options of one `bench quoting` run."""

    configs: tuple[ServerConfig, ...]
    urls: dict[str, str]
    """Configuration name -> the URL of its running server (--url NAME=URL)."""
    passes: int
    requests: int
    seed: int
    lookup_knobs: str
    start: ServerStart
    out: Path
    host_stacks: bool = False
    """After the passes, one more pass of HOST_STACKS_KIND under py-spy (host_cpu_while)."""

    def recorded(self) -> dict:
        """What the measurements file keeps of the plan; merged files must agree on the
        prompts (seed, requests) and passes."""
        return {
            "model": self.start.model,
            "passes": self.passes,
            "requests": self.requests,
            "seed": self.seed,
            "vllm_args": self.start.vllm_args,
            "lookup_knobs": self.lookup_knobs,
        }


def measure_server(
    client: BenchClient, model: str, tasks: dict[str, list[Task]], seed: int, passes: int
) -> list[dict]:
    """The warm-up, then `passes` passes over every kind at C1: per pass, per kind, its row
    and the text of each answer in task order."""
    warm = [kind_tasks[0].request(model, seed, WARM_UP) for kind_tasks in tasks.values()]
    run_pass(client, warm, 1, WARM_UP)
    measured = []
    for number in range(1, passes + 1):
        kinds = {}
        for kind, kind_tasks in tasks.items():
            requests = [task.request(model, seed, str(number)) for task in kind_tasks]
            before = client.counters()
            results, wall_s = run_pass(client, requests, 1, f"pass {number} {kind}")
            counters = ServerCounters.between(before, client.counters())
            row = summarize(
                mode="single",
                data=kind,
                prompt="salted",
                concurrency=1,
                results=results,
                wall_s=wall_s,
                counters=counters,
            )
            print(f"   pass {number}: {format_row(row)}", flush=True)
            kinds[kind] = {
                "row": asdict(row),
                "texts": [result.text for result in results],
                # the row's tokens_per_step counts only steps that drafted: these give every
                # decode step (quoting_result.drafting)
                "counters": asdict(counters),
                "output_tokens": sum(result.output_tokens for result in results),
            }
        measured.append(kinds)
    return measured


@dataclass(frozen=True)
class Launch:
    """How one configuration's server starts here."""

    config: ServerConfig
    command: list[str]
    env: dict[str, str]
    base: str
    log: Path
    parent: Path
    patches: str

    def server(self, start: ServerStart) -> contextlib.AbstractContextManager[HealthyServer]:
        return running_server(
            self.command,
            self.env,
            self.log,
            self.base,
            start.startup_timeout,
            timeout_option="--startup-timeout",
        )


def launch(start: ServerStart, config: ServerConfig) -> Launch:
    """The configuration's server command and environment, its vllm/ tree checked."""
    build_tree = start.stock_vllm if config.build == "vllm" else start.patched_vllm
    parent = Path(build_tree).resolve()  # type: ignore[arg-type]
    patches = check_vllm_tree("stock" if config.build == "vllm" else "patched", parent)
    port = free_port()
    argv, env = config.serve(Path(start.model), port, start.vllm_args, start.env_file, parent)  # type: ignore[arg-type]
    command = server_command(start.server_command, config.name, argv, port)
    if start.start_together:  # servers compiling at once must not write one compile cache
        env = {**env, "VLLM_CACHE_ROOT": str(start.workdir / "cache" / config.name)}
    log = start.workdir / f"{config.name}-server.log"
    print(f"== {config.name}: {' '.join(command)}\n   (vllm/ from {parent}; log {log})", flush=True)
    return Launch(config, command, env, f"http://{SERVER_HOST}:{port}", log, parent, patches)


def _record(config: ServerConfig) -> dict:
    return {
        "build": config.build,
        "baseline": config.baseline,
        "speculative_config": config.speculative_config,
        "knobs": config.knob_values,
        **({"own_vllm_args": config.own_vllm_args} if config.own_vllm_args else {}),
    }


def measure_given(plan: ConfigsPlan, config: ServerConfig, measure: Measure) -> dict:
    """A configuration whose server runs at its --url."""
    print(f"== {config.name}: the server at {plan.urls[config.name]}", flush=True)
    client = BenchClient(plan.urls[config.name], None, plan.start.timeout)
    return {**_record(config), "url": client.base_url, **measure(client, None)}


def measure_started(
    plan: ConfigsPlan, started: Launch, healthy: HealthyServer, measure: Measure
) -> dict:
    """A configuration whose server this run started and that is healthy now."""
    print(f"== {started.config.name}: measuring ({started.base})", flush=True)
    return {
        **_record(started.config),
        "command": started.command,
        "vllm_parent": str(started.parent),
        "patches": started.patches,
        "startup_s": round(healthy.startup_s, 2),
        "log": str(started.log),
        **measure(BenchClient(started.base, None, plan.start.timeout), healthy.process.pid),
    }


def check_pinned_pools(launches: Sequence[Launch]) -> None:
    """ABError unless every server started beside another fixes its KV-cache size
    (ab_run.pins_kv_pool)."""
    unpinned = [one.config.name for one in launches if not pins_kv_pool(one.command)]
    if len(launches) > 1 and unpinned:
        raise ABError(
            pin_needed(f"--start-together: {', '.join(unpinned)}")
            + " (--vllm-args), or start the servers one after another"
        )


@contextlib.contextmanager
def all_healthy(
    start: ServerStart, launches: Sequence[Launch]
) -> Iterator[list[HealthyServer | Exception]]:
    """Every server started at once (server_process.all_running), yielded once all are up or
    have failed, a failed one as its error: the caller measures the others, then raises it
    (raise_failed), so one configuration that cannot start costs no other its measurements."""
    check_pinned_pools(launches)
    with all_running([started.server(start) for started in launches], keep_going=True) as up:
        yield up


def raise_failed(launches: Sequence[Launch], healthy: Sequence[HealthyServer | Exception]) -> None:
    """The first start error of all_healthy's servers, naming every configuration that failed."""
    failed = [(one.config.name, up) for one, up in zip(launches, healthy, strict=True)
              if isinstance(up, Exception)]  # fmt: skip
    if failed:
        names = ", ".join(name for name, _ in failed)
        raise ServerStartError(f"{names} did not start: {failed[0][1]}") from failed[0][1]


def measure_quoting(
    client: BenchClient, plan: QuotingPlan, tasks: dict[str, list[Task]], pid: int | None
) -> dict:
    """`bench quoting`'s part of a configuration's record; with --host-stacks, where a started
    server's host CPU went over one more pass of HOST_STACKS_KIND (its C1 steps copy)."""
    model, max_model_len = served_model(client, None)
    check_fit(client, model, max_model_len, tasks)
    record = {
        "served_model": model,
        "max_model_len": max_model_len,
        "version": server_version(client),
        "passes": measure_server(client, model, tasks, plan.seed, plan.passes),
    }
    if plan.host_stacks and pid is not None:
        record["host_cpu"] = sampled_pass(client, model, tasks[HOST_STACKS_KIND], plan, pid)
    return record


def sampled_pass(
    client: BenchClient, model: str, kind_tasks: list[Task], plan: QuotingPlan, pid: int
) -> dict:
    """One more pass of these tasks (its own salt) with the server's process tree sampled:
    host_cpu_while's figures, the pass's tokens per step, and its stacks printed in ms a step."""
    requests = [task.request(model, plan.seed, HOST_STACKS_SALT) for task in kind_tasks]
    name = client.base_url.rsplit(":", 1)[-1]
    before = client.counters()
    measured = host_cpu_while(
        pid,
        lambda: run_pass(client, requests, 1, "host stacks")[0],
        plan.start.workdir / f"host-stacks-{name}.txt",
    )
    tokens_per_step = ServerCounters.between(before, client.counters()).tokens_per_step
    measured["kind"] = HOST_STACKS_KIND
    measured["tokens_per_step"] = tokens_per_step
    print(
        f"   host CPU over {measured['output_tokens']} {HOST_STACKS_KIND} tokens: busiest "
        f"process {measured['busiest_cpu_s']:.2f} s, all {measured['total_cpu_s']:.2f} s",
        flush=True,
    )
    if measured.get("stacks"):
        steps = steps_sampled(measured["output_tokens"], tokens_per_step)
        print("\n".join(stack_lines(measured["stacks"], steps)), flush=True)
    return measured


def measurements_document(plan: QuotingPlan, command: str, prompts: dict) -> dict:
    """The measurements file before any configuration ran: the facts, the plan, the prompts."""
    return {
        "schema": MEASUREMENTS_SCHEMA,
        "kind": MEASUREMENTS_KIND,
        "date": time.strftime(DATE_FORMAT),
        "gpu": gpu_facts()["gpu"],
        "commit": git_commit(),
        "command": command,
        "plan": plan.recorded(),
        "prompts": prompts,
        "configs": {},
    }


def run_configs(plan: ConfigsPlan, measure: Measure, document: dict) -> dict:
    """Measure every configuration of the plan in turn, writing the document after each.
    Servers started here start one after another, or (--start-together) all at once before the
    first is measured: a starting server's compilation and graph capture would share the GPU
    and the host's cores with the one measured."""

    def keep(name: str, record: dict) -> None:
        document["configs"][name] = record
        save(plan.out, document)

    for config in plan.configs:
        if config.name in plan.urls:
            keep(config.name, measure_given(plan, config, measure))
    launched = [config for config in plan.configs if config.name not in plan.urls]
    if plan.start.start_together:
        launches = [launch(plan.start, config) for config in launched]
        with all_healthy(plan.start, launches) as healthy:
            for started, server in zip(launches, healthy, strict=True):
                if not isinstance(server, Exception):
                    keep(started.config.name, measure_started(plan, started, server, measure))
        raise_failed(launches, healthy)
        return document
    for config in launched:
        started = launch(plan.start, config)
        with started.server(plan.start) as server:
            keep(config.name, measure_started(plan, started, server, measure))
    return document


def save(path: Path, document: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")


def pass_rows(record: dict) -> list[dict[str, Row]]:
    """A configuration record's rows, per pass, per kind."""
    return [
        {kind: Row(**measured["row"]) for kind, measured in kinds.items()}
        for kinds in record["passes"]
    ]

"""A server's host CPU per decode step: the processor time each of its processes spends while
it decodes a few unprofiled C1 requests. The busiest process (vLLM's engine core, which
schedules, prepares inputs and launches the step) also spins on a CPU while it waits for the
GPU (a CUDA synchronize), so its CPU time is about a whole step's wall time either way; with
py-spy's stacks (host_stacks.py) that wait is measured and left out: when the rest, the host
work, is about a step's wall time, the step waits on the host and a shorter GPU step will not
show in TPOT."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import psutil

from hyperqwen.bench.client import BenchClient, StreamResult
from hyperqwen.bench.host_stacks import (
    SAMPLE_RATE_HZ,
    parse,
    sampled,
    stack_lines,
    steps_sampled,
    summarize,
    thread_ms_per_step,
)
from hyperqwen.bench.rows import Row
from hyperqwen.bench.workload import RequestFactory, Workload

HOST_CPU_REQUESTS = 4  # one after another, as the C1 row sends them


def tree_cpu_seconds(pid: int) -> dict[int, float]:
    """User plus system CPU seconds of the process `pid` and each of its descendants, by pid;
    a process that ends between the listing and the read is left out."""
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    spent = {}
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            times = process.cpu_times()
            spent[process.pid] = times.user + times.system
    return spent


def cpu_spent(before: Mapping[int, float], after: Mapping[int, float]) -> dict[str, float]:
    """The busiest process's CPU seconds between two readings, and all processes' together (a
    process that started in between counts from zero)."""
    deltas = [seconds - before.get(pid, 0.0) for pid, seconds in after.items()]
    return {"busiest_cpu_s": max(deltas, default=0.0), "total_cpu_s": sum(deltas)}


def measure_host_cpu(
    client: BenchClient,
    factory: RequestFactory,
    pid: int,
    input_len: int,
    output_len: int,
    stacks_out: Path | None = None,
) -> dict:
    """HOST_CPU_REQUESTS C1 requests of random tokens against the server whose process tree is
    rooted at `pid` (host_cpu_while)."""
    workload = Workload("random", False, input_len, output_len)
    requests = factory.requests(workload, HOST_CPU_REQUESTS)
    return host_cpu_while(pid, lambda: client.stream_many(requests, 1)[0], stacks_out)


def host_cpu_while(
    pid: int, send: Callable[[], Sequence[StreamResult]], stacks_out: Path | None = None
) -> dict:
    """What `send` (requests to the server whose process tree is rooted at `pid`) cost its
    processes: the requests, the output tokens they made and the CPU seconds spent; with
    `stacks_out`, py-spy's samples of the tree meanwhile there (host_stacks.py) and their
    summary under "stacks" (None, and "stacks_note" says why, where none were taken)."""
    with contextlib.ExitStack() as stack:
        raw = stack.enter_context(sampled(pid, stacks_out)) if stacks_out else None
        before = tree_cpu_seconds(pid)
        results = send()
        spent = cpu_spent(before, tree_cpu_seconds(pid))
    tokens = sum(result.output_tokens for result in results)
    measured = {"requests": len(results), "output_tokens": tokens, **spent}
    if stacks_out is None:
        return measured
    if raw is None:
        measured["stacks"] = None
        measured["stacks_note"] = "no py-spy: set HYPERQWEN_PY_SPY or put it on PATH"
    elif not raw.is_file():
        measured["stacks"] = None
        measured["stacks_note"] = f"py-spy wrote no samples: {raw.with_suffix('.log')}"
    else:
        measured["stacks_file"] = str(raw)
        measured["stacks"] = summarize(parse(raw.read_text(encoding="utf-8")), SAMPLE_RATE_HZ)
    return measured


def host_cpu_rows(
    measured: Mapping, tokens_per_step: float | None, wall_ms_per_step: float
) -> dict[str, tuple[str, float | None]]:
    """bench ab figures: CPU ms per decode step of the busiest process and of all of them, and
    the busiest one's share of the step's wall time; with stacks, the busiest thread's wait for
    the GPU in ms per step, and the busiest process's CPU time without it (host work) in ms and
    as a share of the step (near 1: the step waits on the host)."""
    tokens = measured["output_tokens"]
    if not tokens:
        return {}
    per_step = (tokens_per_step or 1.0) / tokens * 1000
    busiest, total = measured["busiest_cpu_s"] * per_step, measured["total_cpu_s"] * per_step
    rows = {
        "c1_host_cpu_ms_per_step": ("ms", round(busiest, 3)),
        "c1_host_cpu_all_processes_ms_per_step": ("ms", round(total, 3)),
        "c1_host_cpu_share_of_step": ("fraction", round(busiest / wall_ms_per_step, 3)),
    }
    thread = thread_ms_per_step(measured, tokens_per_step)
    if thread:
        work = busiest - thread.gpu_wait_ms
        rows["c1_host_gpu_wait_ms_per_step"] = ("ms", round(thread.gpu_wait_ms, 3))
        rows["c1_host_work_ms_per_step"] = ("ms", round(work, 3))
        rows["c1_host_work_share_of_step"] = ("fraction", round(work / wall_ms_per_step, 3))
    return rows


def host_stack_lines(measured: Mapping, rows: Sequence[Row]) -> list[str]:
    """Printable lines of measure_host_cpu's stacks, in ms per step by the C1 row's tokens per
    step; none where stacks were not asked for."""
    if "stacks" not in measured:
        return []
    if measured["stacks"] is None:
        return [f"   host stacks: not sampled ({measured['stacks_note']})"]
    c1 = [row.tokens_per_step for row in rows if row.data == "random" and row.C == 1]
    steps = steps_sampled(measured["output_tokens"], c1[0]) if c1 else None
    return stack_lines(measured["stacks"], steps)

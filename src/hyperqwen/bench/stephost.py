"""What the host thread that runs the engine steps does between one step's start and the next's.

Reads the same torch-profiler trace as bench/stepmap.py. The thread is the one that opens the
execute_context_... step ranges (vLLM's engine core loop, where the worker runs in-process).
A window runs from a decode step range's start to the next range's start, on the host's clock.
Inside it, the thread's time falls into:
- waiting on the GPU: CUDA runtime or driver calls that block the host (synchronizations and
  synchronous copies); a host that waits is ahead of the GPU;
- launching: the calls that hand work to the GPU (kernels, graphs, asynchronous copies);
- other recorded work: the rest of what the profiler recorded on the thread (ATen ops, named
  ranges), by the outermost event's name;
- unrecorded: time in no recorded event, i.e. Python the profiler does not trace (the
  scheduler, output processing, messages to the front end).
An event that encloses a whole window (a range around the engine's loop) counts as none.
A window longer than the GPU's step with little waiting in it is a step the host holds up.
"""

from __future__ import annotations

import itertools
from collections import Counter

from hyperqwen.bench.profile import ProfileError
from hyperqwen.bench.stepmap import (
    CPU_RANGE,
    LAUNCHES,
    STEP_RANGE_PREFIX,
    decode_tokens,
    step_ranges_of,
)

# Calls that return only once the GPU (or a copy to pageable memory) is done.
BLOCKING_CALLS = ("Synchronize", "cudaMemcpy", "cuMemcpyDtoH", "cuMemcpyHtoD")
ASYNC_MARK = "Async"
TOP_HOST_RANGES = 12


def blocks_host(event: dict) -> bool:
    name = str(event.get("name", ""))
    # "Async" anywhere: the driver's names carry a version suffix (cuMemcpyDtoHAsync_v2)
    if event.get("cat") not in LAUNCHES or ASYNC_MARK in name:
        return False
    return any(part in name for part in BLOCKING_CALLS)


def _step_thread(events: list[dict]) -> tuple[object, object, list[dict]]:
    """(pid, tid) of the thread that opens most step ranges, and its step ranges by start."""
    ranges = step_ranges_of(events, CPU_RANGE)
    if not ranges:
        raise ProfileError(
            f"the trace has no CPU {STEP_RANGE_PREFIX}... range: the profiler recorded no "
            "engine step on the host (CPU activity off, or the request ended first)"
        )
    threads = Counter((e.get("pid"), e.get("tid")) for e in ranges)
    pid, tid = max(threads, key=threads.get)
    mine = [e for e in ranges if (e.get("pid"), e.get("tid")) == (pid, tid)]
    return pid, tid, sorted(mine, key=lambda e: float(e["ts"]))


def _union_us(spans: list[tuple[float, float]]) -> float:
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _clipped(event: dict, start: float, end: float) -> tuple[float, float] | None:
    first = max(float(event["ts"]), start)
    last = min(float(event["ts"]) + float(event.get("dur", 0.0)), end)
    return (first, last) if last > first else None


def _outermost(spans: list[tuple[dict, tuple[float, float]]]):
    """The (event, span) pairs no other pair's event contains (one thread's events nest)."""
    outer, reach = [], float("-inf")
    for event, span in sorted(
        spans, key=lambda pair: (float(pair[0]["ts"]), -float(pair[0].get("dur", 0.0)))
    ):
        end = float(event["ts"]) + float(event.get("dur", 0.0))
        if float(event["ts"]) >= reach:
            outer.append((event, span))
            reach = end
        else:
            reach = max(reach, end)
    return outer


def host_summary(events: list[dict]) -> dict:
    """Per decode-step window on the step thread: its length and where the thread's time went
    (ms per step), plus the outermost recorded events by name."""
    pid, tid, ranges = _step_thread(events)
    thread = sorted(
        (
            e
            for e in events
            if e.get("ph") == "X"
            and (e.get("pid"), e.get("tid")) == (pid, tid)
            and "ts" in e
            and float(e.get("dur", 0.0)) > 0
        ),
        key=lambda e: float(e["ts"]),
    )
    totals: Counter[str] = Counter()
    by_name: Counter[str] = Counter()
    count_by_name: Counter[str] = Counter()
    windows = 0
    for current, following in itertools.pairwise(ranges):
        if decode_tokens(current) is None:
            continue
        windows += 1
        start, end = float(current["ts"]), float(following["ts"])
        totals["window"] += end - start
        # an event enclosing the whole window (a range around the engine's loop) says nothing
        # of where this step's time went
        inside = [
            (event, span)
            for event in thread
            if (span := _clipped(event, start, end)) and span != (start, end)
        ]
        totals["recorded"] += _union_us([span for _, span in inside])
        totals["waiting"] += _union_us([span for e, span in inside if blocks_host(e)])
        totals["launching"] += _union_us(
            [span for e, span in inside if e.get("cat") in LAUNCHES and not blocks_host(e)]
        )
        for event, (first, last) in _outermost(inside):
            by_name[str(event.get("name", "?"))] += last - first
            count_by_name[str(event.get("name", "?"))] += 1
    if not windows:
        raise ProfileError(
            f"none of the trace's {len(ranges)} host step range(s) opens a decode step that "
            "another range follows: profile more steps"
        )

    def per_step(us: float) -> float:
        return round(us / 1000.0 / windows, 4)

    return {
        "windows": windows,
        "host_window_ms": per_step(totals["window"]),
        "host_waiting_on_gpu_ms": per_step(totals["waiting"]),
        "host_launching_ms": per_step(totals["launching"]),
        "host_other_recorded_ms": per_step(
            totals["recorded"] - totals["waiting"] - totals["launching"]
        ),
        "host_unrecorded_ms": per_step(totals["window"] - totals["recorded"]),
        "host_outermost": [
            {
                "name": name[:120],
                "count_per_step": round(count_by_name[name] / windows, 3),
                "ms_per_step": per_step(us),
            }
            for name, us in by_name.most_common(TOP_HOST_RANGES)
        ],
    }


HOST_FIGURES = (
    "host_window_ms",
    "host_waiting_on_gpu_ms",
    "host_launching_ms",
    "host_other_recorded_ms",
    "host_unrecorded_ms",
)
# The profiler records every op the thread runs, which slows the host: these rows describe the
# profiled window, not the unprofiled one (bench/host_cpu.py measures that).
ROW_PREFIX = "profiled_"


def host_rows(host: dict) -> dict[str, tuple[str, float]]:
    """Result rows (name -> unit, value) of a host summary."""
    return {f"{ROW_PREFIX}{name}": ("ms", host[name]) for name in HOST_FIGURES}


def host_lines(host: dict) -> list[str]:
    """The host's share of a step map as text."""
    lines = [
        f"host step thread, per step ({host['windows']} windows): {host['host_window_ms']} ms "
        f"from one step's start to the next; waiting on the GPU "
        f"{host['host_waiting_on_gpu_ms']} ms, launching {host['host_launching_ms']} ms, other "
        f"recorded work {host['host_other_recorded_ms']} ms, unrecorded (untraced Python) "
        f"{host['host_unrecorded_ms']} ms",
        "(the profiler slows the host: an unprofiled step's host time is less)",
        "outermost recorded events on it:",
    ]
    lines += [
        f"  {e['ms_per_step']:.4f} ms, {e['count_per_step']:g}x  {e['name']}"
        for e in host["host_outermost"]
    ]
    return lines

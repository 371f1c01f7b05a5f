"""Where a decode step's GPU time goes, per kernel category, from vLLM's own torch profiler.

`hyperqwen bench ab --profile-steps N` starts both servers with vLLM's `--profiler-config`
(torch profiler, no Python stacks, front end left out, at most N engine steps), and after the
measured rows sends one C1 request between `/start_profile` and `/stop_profile`. The worker's
trace (Chrome trace JSON) is summed here: GPU kernel, memset and memcpy time per category, per
engine step (one step = one CPU range the worker names `execute_context_..._generation_...`),
plus the heaviest kernels.
Kernels inside CUDA graphs are recorded one by one, as in an eager step.
"""

from __future__ import annotations

import gzip
import json
import re
import time
from collections import Counter
from pathlib import Path

# First match wins: the W4A16 kernels before any generic GEMM pattern, GDN before attention.
CATEGORIES: tuple[tuple[str, re.Pattern], ...] = tuple(
    (name, re.compile(pattern, re.IGNORECASE))
    for name, pattern in (
        ("w4a16_gemm", r"machete|marlin|gptq|w4a16|humming|exllama"),
        ("gdn", r"gated_delta|fused_recurrent|chunk_|fla_|gdn|conv1d|l2norm"),
        ("attention", r"flash|fmha|attention|attn"),
        ("dense_gemm", r"gemv|gemm|cutlass|xmma|nvjet|cublas|sm90_|sm80_"),
        ("norm_activation", r"norm|silu|gelu|act_and_mul|rotary|rope"),
        ("sampling", r"sampl|argmax|topk|top_k|softmax|rejection|gumbel|exponential"),
        ("memory", r"memset|memcpy|copy|fill|cat_|index|gather|scatter"),
    )
)
OTHER = "other"
GPU_EVENT_CATEGORIES = frozenset({"kernel", "gpu_memset", "gpu_memcpy"})
# vLLM's worker wraps every engine step it profiles in a CPU range named
# execute_context_C(T)_generation_G(T) (gpu_worker.annotate_profile); the profiler also records
# a GPU copy of it (gpu_user_annotation), which is not another step.
STEP_RANGE_PREFIX = "execute_context_"
TOP_KERNELS = 40  # enough to name most of "other", the bucket no pattern claims
TRACE_WAIT_S = 120


class ProfileError(RuntimeError):
    """A profile that cannot be summed; the message says what is missing."""


def profiler_flags(trace_dir: Path, steps: int, delay_steps: int) -> list[str]:
    """vLLM's --profiler-config for a short window of decode steps."""
    config = {
        "profiler": "torch",
        "torch_profiler_dir": str(trace_dir.resolve()),
        "torch_profiler_with_stack": False,
        "ignore_frontend": True,
        "delay_iterations": delay_steps,
        "max_iterations": steps,
    }
    return ["--profiler-config", json.dumps(config, separators=(",", ":"))]


def category(kernel_name: str) -> str:
    for name, pattern in CATEGORIES:
        if pattern.search(kernel_name):
            return name
    return OTHER


def load_trace(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        document = json.load(handle)
    events = document.get("traceEvents") if isinstance(document, dict) else None
    if not isinstance(events, list):
        raise ProfileError(f"{path}: no traceEvents list (not a torch profiler trace)")
    return events


def is_step(event: dict) -> bool:
    return (
        event.get("ph") == "X"
        and event.get("cat") == "user_annotation"
        and str(event.get("name", "")).startswith(STEP_RANGE_PREFIX)
    )


def summarize(events: list[dict]) -> dict:
    """GPU time per engine step: total, per category, the heaviest kernels (ms per step)."""
    steps = sum(1 for event in events if is_step(event))
    if steps == 0:
        raise ProfileError(
            f"the trace has no {STEP_RANGE_PREFIX}... range: no engine step was profiled (the "
            "request ended before the profiler's delay, or CPU activity was off)"
        )
    by_category: Counter[str] = Counter()
    by_kernel: Counter[str] = Counter()
    launches: Counter[str] = Counter()
    for event in events:
        if event.get("ph") != "X" or event.get("cat") not in GPU_EVENT_CATEGORIES:
            continue
        name = str(event.get("name", "?"))
        duration_us = float(event.get("dur", 0.0))
        by_category[category(name)] += duration_us
        by_kernel[name] += duration_us
        launches[name] += 1
    per_step = 1000.0 * steps  # microseconds summed over the window -> ms per step
    return {
        "steps": steps,
        "gpu_ms_per_step": round(sum(by_category.values()) / per_step, 4),
        "categories": {
            name: round(by_category[name] / per_step, 4)
            for name in [*(name for name, _ in CATEGORIES), OTHER]
            if by_category[name]
        },
        "top_kernels": [
            {
                "name": name[:160],
                "ms_per_step": round(us / per_step, 4),
                "launches_per_step": round(launches[name] / steps, 2),
            }
            for name, us in by_kernel.most_common(TOP_KERNELS)
        ],
    }


def newest_trace(trace_dir: Path, since: float, wait_s: float = TRACE_WAIT_S) -> Path:
    """The worker trace written after `since` (the profiler writes it when it stops)."""
    deadline = time.monotonic() + wait_s
    while True:
        traces = [
            path
            for path in trace_dir.glob("**/*.pt.trace.json*")
            if path.stat().st_mtime >= since and not path.name.endswith(".tmp")
        ]
        if traces:
            return max(traces, key=lambda path: path.stat().st_mtime)
        if time.monotonic() > deadline:
            raise ProfileError(f"no trace appeared in {trace_dir} within {wait_s:.0f} s")
        time.sleep(1.0)


def profile_rows(summary: dict) -> dict[str, tuple[str, float | None]]:
    """bench ab figures (row name -> unit, value) of one side's summary."""
    figures = {"step_gpu_ms": ("ms", summary["gpu_ms_per_step"])}
    for name, value in summary["categories"].items():
        figures[f"step_gpu_ms_{name}"] = ("ms", value)
    return figures

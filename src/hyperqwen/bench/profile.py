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

from hyperqwen.bench.client import BenchClient
from hyperqwen.bench.workload import RequestFactory, Workload

# First match wins: the W4A16 kernels before any generic GEMM pattern, GDN before attention.
CATEGORIES: tuple[tuple[str, re.Pattern], ...] = tuple(
    (name, re.compile(pattern, re.IGNORECASE))
    for name, pattern in (
        ("w4a16_gemm", r"machete|marlin|gptq|w4a16|humming|exllama"),
        # _ba_kernel: HyperQwen's GDN b/a projection (kernels/ba_proj.py)
        # fused_sigmoid_gating_delta_rule_update_kernel: vLLM's GDN decode recurrence
        (
            "gdn",
            r"gated_delta|delta_rule|fused_recurrent|chunk_|fla_|gdn|conv1d|l2norm|_ba_kernel",
        ),
        ("attention", r"flash|fmha|attention|attn"),
        # _draft_argmax_kernel: the draft head's GEMV with its argmax (kernels/draft_argmax.py),
        # where the bf16 draft head's cuBLAS GEMM was
        ("dense_gemm", r"gemv|gemm|cutlass|xmma|nvjet|cublas|sm90_|sm80_|_draft_argmax"),
        # rsqrt: an RMS norm that torch.compile fused into a Triton kernel (triton_red_fused_...);
        # sigmoid: the attention's output gate (GDN's sigmoid gating is claimed above)
        ("norm_activation", r"norm|rsqrt|silu|gelu|sigmoid|act_and_mul|rotary|rope"),
        ("sampling", r"sampl|argmax|topk|top_k|softmax|rejection|gumbel|exponential"),
        ("memory", r"memset|memcpy|copy|fill|cat_|index|gather|scatter|split"),
    )
)
OTHER = "other"
# torch.compile (Inductor) names a fused pointwise or reduction kernel after the ops it took
# from the graph, and those include the GEMM whose input or output it handles:
# triton_red_fused__to_copy_add_fused_add_rms_norm_marlin_gemm_3 is the residual add and RMS
# norm in front of a Marlin GEMM. Such a kernel is never the GEMM itself (Inductor's own GEMMs
# are templates, triton_tem_...), so the GEMM categories do not claim it.
INDUCTOR_POINTWISE_OR_REDUCTION = re.compile(r"triton_(?:poi|red|per)_fused")
GEMM_CATEGORIES = frozenset({"w4a16_gemm", "dense_gemm"})
GPU_EVENT_CATEGORIES = frozenset({"kernel", "gpu_memset", "gpu_memcpy"})
# vLLM's worker wraps every engine step it profiles in a CPU range named
# execute_context_C(T)_generation_G(T) (gpu_worker.annotate_profile); the profiler also records
# a GPU copy of it (gpu_user_annotation), which is not another step.
STEP_RANGE_PREFIX = "execute_context_"
TOP_KERNELS = 40  # enough to name most of "other", the bucket no pattern claims
TRACE_WAIT_S = 120
# engine steps the profiler lets pass before recording: the prefill and the first decodes
PROFILE_DELAY_STEPS = 3
# tokens one profiled step can emit at most, with room: the request outlasts the window
TOKENS_PER_STEP_BOUND = 17


class ProfileError(RuntimeError):
    """A profile that cannot be summed; the message says what is missing."""


def profiler_flags(trace_dir: Path, steps: int, delay_steps: int) -> list[str]:
    """vLLM's --profiler-config for a short window of decode steps. vLLM 0.26's worker always
    records CPU and CUDA activity (gpu_worker.py passes both), so the window stays short; the
    summary table it would print on stop is left out (averaging every event took minutes)."""
    config = {
        "profiler": "torch",
        "torch_profiler_dir": str(trace_dir.resolve()),
        "torch_profiler_with_stack": False,
        "torch_profiler_dump_cuda_time_total": False,
        "ignore_frontend": True,
        "delay_iterations": delay_steps,
        "max_iterations": steps,
    }
    return ["--profiler-config", json.dumps(config, separators=(",", ":"))]


def category(kernel_name: str) -> str:
    never = GEMM_CATEGORIES if INDUCTOR_POINTWISE_OR_REDUCTION.match(kernel_name) else ()
    for name, pattern in CATEGORIES:
        if name not in never and pattern.search(kernel_name):
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


def profile_one_request(
    client: BenchClient,
    factory: RequestFactory,
    input_len: int,
    steps: int,
    trace_dir: Path,
    concurrency: int = 1,
) -> Path:
    """One C1 request (or `concurrency` at once) between /start_profile and /stop_profile
    against a server started with profiler_flags(trace_dir, steps, PROFILE_DELAY_STEPS); the
    trace it wrote."""
    output_len = (PROFILE_DELAY_STEPS + steps + 2) * TOKENS_PER_STEP_BOUND
    workload = Workload("random", False, input_len, output_len)
    since = time.time()
    client.post("/start_profile")
    client.stream_many(factory.requests(workload, concurrency), concurrency)
    client.post("/stop_profile")
    return newest_trace(trace_dir, since)


def profile_rows(summary: dict) -> dict[str, tuple[str, float | None]]:
    """bench ab figures (row name -> unit, value) of one side's summary."""
    figures = {"step_gpu_ms": ("ms", summary["gpu_ms_per_step"])}
    for name, value in summary["categories"].items():
        figures[f"step_gpu_ms_{name}"] = ("ms", value)
    return figures

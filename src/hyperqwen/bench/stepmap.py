"""One served decode step, kernel by kernel: what runs, how often, how long, how many bytes the
GEMMs move, and how long the GPU sits idle between kernels.

Reads the Chrome trace of vLLM's torch profiler (bench/profile.py starts it). Steps: vLLM's
worker wraps execute_model (the target's forward and its logits) in a range named
execute_context_C(T)_generation_G(T), and the profiler copies that range onto the GPU timeline
(a gpu_user_annotation spanning the GPU work launched inside it, CUDA-graph kernels included;
where a trace has none, the same extent is derived from the launches inside the CPU range).
The step's sampling, rejection and MTP drafting (sample_tokens) launch after the range, before
the next step's. So on the GPU a step runs from the start of its range to the start of the
next one, and its forward ends where its range ends. The last range has no next one: its
tail may lie past the profiler's stop, so it is not counted.

Kernels are classed by name (profile.category), then by phase: in the forward, the WnA16 GEMMs
are matched in launch order to the geometry's layers (each layer launches its GEMMs in a fixed
order; Marlin's and Machete's names and grids do not tell shapes apart), the lm_head last;
after the forward, whatever is not sampling or a copy engine transfer is the MTP drafter (its
weight-only GEMMs a class of their own).

The window also splits by CUDA graphs: an op a cudaGraphLaunch ran carries that call's
correlation id, so busy and idle time fall inside a replay (its ops, the gaps between them) or
outside (eager ops, the host's gaps).
"""

from __future__ import annotations

import bisect
import itertools
import re
from collections import Counter, defaultdict
from dataclasses import dataclass

from hyperqwen.bench.kernels import LAYER_GEMMS, LinearShape, linear_kinds, moved_bytes
from hyperqwen.bench.profile import (
    GPU_EVENT_CATEGORIES,
    OTHER,
    STEP_RANGE_PREFIX,
    ProfileError,
    category,
)
from hyperqwen.checkpoint.geometry import Geometry, text_config
from hyperqwen.checkpoint.w4a16_sizes import matches

STEP_NAME = re.compile(r"execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)")
GPU_RANGE = "gpu_user_annotation"
CPU_RANGE = "user_annotation"
# The trace's categories of launches: cudaLaunchKernel, cudaGraphLaunch, cudaMemcpyAsync ...
# and the driver's cuLaunchKernel (Triton's launcher)
LAUNCHES = frozenset({"cuda_runtime", "cuda_driver"})
# A CUDA graph's replay: every kernel and copy of the graph carries this call's correlation id.
GRAPH_LAUNCHES = frozenset({"cudaGraphLaunch", "cuGraphLaunch"})
WNA16 = "w4a16_gemm"  # profile.py's category of every weight-only GEMM kernel (int4 and int8)
LM_HEAD = "lm_head"
BODY_PREFIX = "body_"
UNMATCHED_GEMMS = "wna16_gemm_unmatched"
DRAFTER = "mtp_drafter"
DRAFTER_GEMMS = "mtp_drafter_wna16_gemm"  # the MTP layer's and the draft head's, where quantized
SAMPLING = "sampling"
COPIES = "splits_copies"
# Forward kernels by profile.py's category; the WnA16 GEMMs are matched by order instead.
FORWARD_CLASSES = {
    "gdn": "gdn",
    "attention": "attention",
    "dense_gemm": "dense_gemm",
    "norm_activation": "norm_activation",
    "sampling": SAMPLING,
    "memory": COPIES,
    OTHER: OTHER,
}
# Copy-engine transfers, not kernels: after the forward they are the sampled tokens going to the
# host and the next step's inputs coming in, not drafting.
TRANSFERS = frozenset({"gpu_memcpy", "gpu_memset"})
# A gap inside a CUDA graph (one kernel draining, the next ramping up) takes a few microseconds;
# the host preparing or waiting takes tens. Gaps at or above this split count as host gaps.
GAP_SPLIT_US = 5.0
TOP_GAPS = 12


@dataclass(frozen=True)
class GpuOp:
    name: str
    kind: str  # the trace's cat: kernel, gpu_memcpy, gpu_memset
    start: float  # microseconds
    end: float
    graph: int | None = None  # the correlation id of the graph replay that ran it; None: eager


@dataclass(frozen=True)
class Step:
    tokens: int  # the target's tokens this step (the range's generation tokens): its GEMMs' M
    start: float
    forward_end: float
    end: float
    ops: tuple[GpuOp, ...]  # by start


@dataclass(frozen=True)
class ModelFacts:
    """What the byte counts need: the geometry and the lm_head's weight bits (16: bf16)."""

    geometry: Geometry
    lm_head_bits: int

    def forward_gemms(self) -> list[str]:
        """The WnA16 GEMMs one forward launches, in order; a bf16 lm_head is a dense GEMM."""
        names = [name for kind in self.geometry.layer_types for name in LAYER_GEMMS[kind]]
        return names + ([LM_HEAD] if self.lm_head_bits < 16 else [])

    def shapes(self) -> dict[str, LinearShape]:
        g = self.geometry
        shapes = {shape.name: shape for shape in linear_kinds(g)}
        shapes[LM_HEAD] = LinearShape(LM_HEAD, g.vocab_size, g.hidden_size, 1, self.lm_head_bits)
        return shapes


def model_facts(config: dict) -> ModelFacts:
    """The facts of a checkpoint's config.json: its text geometry and its lm_head's bits (a
    quantization group naming lm_head gives them; in `ignore` it is bf16; else the group that
    targets every Linear, i.e. the body's)."""
    geometry = Geometry.from_text_config(text_config(config))
    quantization = config.get("quantization_config") or {}
    groups = (quantization.get("config_groups") or {}).values()
    named = [g for g in groups if any(t != "Linear" and matches(t, LM_HEAD) for t in g["targets"])]
    if named:
        bits = named[0]["weights"]["num_bits"]
    elif not quantization or any(
        matches(entry, LM_HEAD) for entry in quantization.get("ignore", [])
    ):
        bits = 16
    else:
        bits = next(g["weights"]["num_bits"] for g in groups if "Linear" in g["targets"])
    return ModelFacts(geometry, bits)


def _correlation(event: dict):
    return (event.get("args") or {}).get("correlation")


def gpu_ops(events: list[dict]) -> list[GpuOp]:
    """The GPU's kernels and copies by start, each with the graph replay that ran it (matched
    by correlation id to a cudaGraphLaunch), if any."""
    replays = {
        _correlation(e)
        for e in events
        if e.get("cat") in LAUNCHES and e.get("name") in GRAPH_LAUNCHES
    }
    replays.discard(None)
    ops = []
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in GPU_EVENT_CATEGORIES:
            continue
        start, correlation = float(e["ts"]), _correlation(e)
        graph = correlation if correlation in replays else None
        ops.append(GpuOp(str(e.get("name", "?")), e["cat"], start, start + float(e["dur"]), graph))
    return sorted(ops, key=lambda op: op.start)


def step_ranges_of(events: list[dict], cat: str) -> list[dict]:
    """The step ranges (execute_context_...) of one category: the CPU's or the GPU's copy."""
    return [
        e
        for e in events
        if e.get("ph") == "X"
        and e.get("cat") == cat
        and str(e.get("name", "")).startswith(STEP_RANGE_PREFIX)
    ]


def _ranges_from_launches(events: list[dict]) -> list[dict]:
    """Each CPU step range's extent on the GPU, from the ops whose launches (CUDA runtime calls,
    matched by correlation id) lie inside it: what the profiler's GPU copy of a range spans."""
    cpu_ranges = sorted(step_ranges_of(events, CPU_RANGE), key=lambda e: float(e["ts"]))
    starts = [float(e["ts"]) for e in cpu_ranges]
    launched_at = {
        e["args"]["correlation"]: float(e["ts"])
        for e in events
        if e.get("cat") in LAUNCHES and _correlation(e) is not None
    }
    extents: dict[int, list[float]] = {}
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in GPU_EVENT_CATEGORIES:
            continue
        launch = launched_at.get(_correlation(e))
        index = bisect.bisect_right(starts, launch) - 1 if launch is not None else -1
        if index < 0 or launch > starts[index] + float(cpu_ranges[index]["dur"]):
            continue  # launched outside every step range: sampling and drafting
        start, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        extent = extents.setdefault(index, [start, end])
        extent[:] = [min(extent[0], start), max(extent[1], end)]
    return [
        {"name": cpu_ranges[i]["name"], "ts": first, "dur": last - first}
        for i, (first, last) in sorted(extents.items())
    ]


def _step_ranges(events: list[dict]) -> list[dict]:
    """The step ranges on the GPU timeline: the profiler's GPU copies on the stream that holds
    most of them (it draws one per stream that ran work of the range; the compute stream has
    every step), else derived from the CPU ranges' launches."""
    ranges = step_ranges_of(events, GPU_RANGE)
    if ranges:
        streams = Counter((e.get("pid"), e.get("tid")) for e in ranges)
        stream = max(streams, key=streams.get)
        ranges = [e for e in ranges if (e.get("pid"), e.get("tid")) == stream]
    else:
        ranges = _ranges_from_launches(events)
    if not ranges:
        raise ProfileError(
            f"the trace has no step range ({STEP_RANGE_PREFIX}...) that launched GPU work: no "
            "engine step reached the GPU while the profiler ran (the request ended before the "
            "profiler's delay, or the trace has no CPU activity to name the steps)"
        )
    return sorted(ranges, key=lambda e: float(e["ts"]))


def decode_tokens(step_range: dict) -> int | None:
    """The target's tokens of a step range that is a decode step (no prefill in it, at least
    one generating request): its GEMMs' M; None for any other step."""
    match = STEP_NAME.match(str(step_range["name"]))
    if not match or int(match[1]) or not int(match[3]):
        return None
    return int(match[4])


def segment(events: list[dict]) -> tuple[list[Step], int]:
    """The decode steps of a trace (no prefill in them, at least one generating request) and
    how many other complete steps were left out."""
    ranges = _step_ranges(events)
    ops = gpu_ops(events)
    steps, left_out = [], 0
    for current, following in itertools.pairwise(ranges):
        tokens = decode_tokens(current)
        if tokens is None:
            left_out += 1
            continue
        start, end = float(current["ts"]), float(following["ts"])
        inside = tuple(op for op in ops if start <= op.start < end)
        forward_end = start + float(current["dur"])
        steps.append(Step(tokens, start, forward_end, end, inside))
    if not steps:
        raise ProfileError(
            f"none of the trace's {len(ranges)} step range(s) is a complete decode step (one "
            "more range must follow a decode step's): profile more steps"
        )
    return steps, left_out


def classify(step: Step, facts: ModelFacts) -> tuple[list[str], bool]:
    """Each op's class, in step order, and whether the forward's WnA16 GEMMs matched the
    geometry's sequence (if not, they are all UNMATCHED_GEMMS)."""
    expected = facts.forward_gemms()
    forward_gemms = [
        op for op in step.ops if op.start < step.forward_end and category(op.name) == WNA16
    ]
    matched = len(forward_gemms) == len(expected)
    in_order = iter(expected)  # the forward's GEMMs come in step order, as its ops do
    classes = []
    for op in step.ops:
        base = category(op.name)
        if op.start >= step.forward_end:
            if base in (SAMPLING, WNA16):
                classes.append(SAMPLING if base == SAMPLING else DRAFTER_GEMMS)
            else:
                classes.append(COPIES if op.kind in TRANSFERS else DRAFTER)
        elif base == WNA16 and matched:
            name = next(in_order)
            classes.append(name if name == LM_HEAD else BODY_PREFIX + name)
        elif base == WNA16:
            classes.append(UNMATCHED_GEMMS)
        else:
            classes.append(FORWARD_CLASSES[base])
    return classes, matched


@dataclass(frozen=True)
class Gaps:
    busy_us: float  # the union of the step's ops: overlapping streams count once
    short_us: float  # idle in gaps below the split
    long_us: float
    count: int
    long_gaps: tuple[tuple[str, str, float], ...]  # (op before, op after, microseconds)
    graph_busy_us: float  # of busy_us, what CUDA graph replays ran (first to cover a moment)
    graph_idle_us: float  # idle between two ops of one graph replay


def gaps(step: Step, split_us: float = GAP_SPLIT_US) -> Gaps:
    """Where the GPU ran nothing inside the step's window: between the ops (merged where
    streams overlap) and from the last op to the next step's first; and how much of the busy
    and idle time lies inside CUDA graph replays (a gap between two ops of one replay), the
    rest being eager work and the host's gaps around it."""
    busy = graph_busy = graph_idle = 0.0
    idle = []  # (op before, op after, microseconds)
    reach, last = step.start, None
    for op in step.ops:
        if op.start > reach:
            idle.append((last.name if last else "", op.name, op.start - reach))
            if last and op.graph is not None and op.graph == last.graph:
                graph_idle += op.start - reach
        end = min(op.end, step.end)
        if end > reach:
            covered = end - max(op.start, reach)
            busy += covered
            graph_busy += covered if op.graph is not None else 0.0
            reach, last = end, op
    if step.end > reach:
        idle.append((last.name if last else "", "(next step)", step.end - reach))
    long_gaps = tuple(gap for gap in idle if gap[2] >= split_us)
    short = sum((us for _, _, us in idle if us < split_us), 0.0)
    long = sum((us for _, _, us in long_gaps), 0.0)
    return Gaps(busy, short, long, len(idle), long_gaps, graph_busy, graph_idle)


def _ms(us: float, steps: int) -> float:
    return round(us / 1000.0 / steps, 4)


def window_figures(steps: list[Step], split_us: float = GAP_SPLIT_US) -> dict:
    """Per-step means of the GPU's window (one step range's start to the next's), which need no
    model facts: busy time (the union of its ops, overlapping ones once), idle in short and
    long gaps, and both split by CUDA graph replays."""
    n = len(steps)
    totals: Counter[str] = Counter()
    for step in steps:
        found = gaps(step, split_us)
        totals["span"] += step.end - step.start
        totals["busy"] += found.busy_us
        totals["short"] += found.short_us
        totals["long"] += found.long_us
        totals["graph_busy"] += found.graph_busy_us
        totals["graph_idle"] += found.graph_idle_us
        totals["replays"] += len({op.graph for op in step.ops} - {None})
        totals["gaps"] += found.count
        totals["ops"] += len(step.ops)
    return {
        "step_span_ms": _ms(totals["span"], n),
        "step_busy_ms": _ms(totals["busy"], n),
        "idle_ms": _ms(totals["span"] - totals["busy"], n),
        "idle_short_gaps_ms": _ms(totals["short"], n),
        "idle_long_gaps_ms": _ms(totals["long"], n),
        "gap_split_us": split_us,
        # the window split by CUDA graphs: a replay's span is its ops and the gaps between
        # them; the rest is eager ops and the host's gaps around them
        "graph_replays_per_step": round(totals["replays"] / n, 2),
        "graph_busy_ms": _ms(totals["graph_busy"], n),
        "graph_idle_ms": _ms(totals["graph_idle"], n),
        "outside_graphs_busy_ms": _ms(totals["busy"] - totals["graph_busy"], n),
        "outside_graphs_idle_ms": _ms(totals["span"] - totals["busy"] - totals["graph_idle"], n),
        "gaps_per_step": round(totals["gaps"] / n, 2),
        "launches_per_step": round(totals["ops"] / n, 2),
    }


def window_rows(window: dict) -> dict[str, tuple[str, float]]:
    """bench ab's rows of a profile's window_figures: the GPU's busy time per step (overlapping
    ops once, so a kernel that starts before its predecessor ends does not count its wait), the
    idle time inside CUDA graph replays (kernel to kernel) and the profiled step's whole window."""
    return {
        "step_gpu_busy_ms": ("ms", window["step_busy_ms"]),
        "step_graph_idle_ms": ("ms", window["graph_idle_ms"]),
        "profiled_step_window_ms": ("ms", window["step_span_ms"]),
    }


def summarize_steps(
    steps: list[Step], facts: ModelFacts, split_us: float = GAP_SPLIT_US, left_out: int = 0
) -> dict:
    """Per-step means over the decode steps: classes, GEMMs by M with their bytes, gaps."""
    n = len(steps)
    class_us: Counter[str] = Counter()
    class_count: Counter[str] = Counter()
    other_us: Counter[str] = Counter()
    other_count: Counter[str] = Counter()
    gemm_us: dict[int, Counter[str]] = defaultdict(Counter)
    gemm_count: dict[int, Counter[str]] = defaultdict(Counter)
    steps_at: Counter[int] = Counter()
    gap_pairs_us: Counter[tuple[str, str]] = Counter()
    gap_pairs_count: Counter[tuple[str, str]] = Counter()
    totals = Counter()
    matched_steps = 0
    for step in steps:
        classes, matched = classify(step, facts)
        matched_steps += matched
        steps_at[step.tokens] += 1
        for op, name in zip(step.ops, classes, strict=True):
            duration = op.end - op.start
            class_us[name] += duration
            class_count[name] += 1
            totals["gpu"] += duration
            if name == OTHER:
                other_us[op.name] += duration
                other_count[op.name] += 1
            if name == LM_HEAD or name.startswith(BODY_PREFIX):
                gemm_us[step.tokens][name.removeprefix(BODY_PREFIX)] += duration
                gemm_count[step.tokens][name.removeprefix(BODY_PREFIX)] += 1
        for before, after, idle in gaps(step, split_us).long_gaps:
            gap_pairs_us[before, after] += idle
            gap_pairs_count[before, after] += 1
    shapes = facts.shapes()
    gemms = {}
    for m, by_name in sorted(gemm_us.items()):
        rows = {}
        for name, us in by_name.items():
            shape = shapes[name]
            launches = gemm_count[m][name]
            rows[name] = {
                "launches_per_step": round(launches / steps_at[m], 3),
                "ms_per_step": _ms(us, steps_at[m]),
                "bytes_per_launch": moved_bytes(m, shape.n, shape.k, bits=shape.bits),
                "gbps": round(
                    launches * moved_bytes(m, shape.n, shape.k, bits=shape.bits) / us / 1e3, 1
                ),
            }
        gemms[str(m)] = rows
    return {
        "steps": n,
        "steps_left_out": left_out,
        "steps_by_tokens": {str(m): count for m, count in sorted(steps_at.items())},
        "gemm_order_matched_steps": matched_steps,
        "forward_gemms_expected": len(facts.forward_gemms()),
        "step_gpu_ms": _ms(totals["gpu"], n),
        **window_figures(steps, split_us),
        "classes": {
            name: {
                "launches_per_step": round(class_count[name] / n, 3),
                "ms_per_step": _ms(us, n),
            }
            for name, us in class_us.most_common()
        },
        "gemms": gemms,
        "other_kernels": [
            {
                "name": name[:160],
                "launches_per_step": round(other_count[name] / n, 3),
                "ms_per_step": _ms(us, n),
            }
            for name, us in other_us.most_common()
        ],
        "long_gaps": [
            {
                "before": before[:120],
                "after": after[:120],
                "count_per_step": round(gap_pairs_count[before, after] / n, 3),
                "ms_per_step": _ms(us, n),
            }
            for (before, after), us in gap_pairs_us.most_common(TOP_GAPS)
        ],
    }

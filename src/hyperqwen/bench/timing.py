"""The timing harness every kernel benchmark (`bench kernels`, `bench gdn`, `bench draft-head`)
shares: launches replayed from a CUDA graph over operands larger than L2, the copy bandwidth they
are measured against, the GPU they ran on, the options every one takes and its result file's
header."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from hyperqwen.checkpoint.geometry import PRESETS

# The operands a timed graph rotates through add up to at least this, far more than a GPU's
# L2 holds: every launch reads its operands from HBM.
L2_ROTATION_BYTES = 256 * 2**20


def graph_time_us(launches: list[Callable[[], object]], replays: int = 15) -> float:
    """Median time of one launch, replaying a CUDA graph of all `launches` (one per copy)."""
    import torch

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for launch in launches:  # warm up: compile, allocate workspaces
            launch()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for launch in launches:
            launch()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / len(launches))
    return statistics.median(times)


def copy_bandwidth_gbps() -> float:
    """Device-to-device copy of 4 GiB, bytes read plus written per second, median of 10.

    Timed eagerly with events: captured in a CUDA graph the same copy_ becomes a memcpy node
    that ran at 2.77 TB/s on the H200 where the eager copy kernel reads 4.19 (2026-12-01). Copies
    for about a second first: an idle H200 sits at 345 MHz.
    """
    import torch

    src = torch.empty(2**32, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    warm_until = time.monotonic() + 1.0
    while time.monotonic() < warm_until:
        dst.copy_(src)
        torch.cuda.synchronize()
    times_ms = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times_ms.append(start.elapsed_time(end))
    return 2 * src.numel() / (statistics.median(times_ms) * 1e-3) / 1e9


def gpu_name() -> str:
    import torch

    return torch.cuda.get_device_properties(0).name


def gpu_label() -> str:
    """The GPU a result file names: model, compute capability and SMs."""
    import torch

    props = torch.cuda.get_device_properties(0)
    return f"{props.name} (sm{props.major}{props.minor}, {props.multi_processor_count} SMs)"


def add_timing_parser(actions, name: str, help: str, description: str, default_out: str):
    """A GPU kernel-timing subcommand with the options every one takes: --preset, --out and
    --commit."""
    formatter = argparse.RawDescriptionHelpFormatter
    parser = actions.add_parser(name, help=help, description=description, formatter_class=formatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="27b")
    parser.add_argument("--out", default=default_out, help="result JSON (default %(default)s)")
    parser.add_argument(
        "--commit",
        help="the checkout's commit, when running from a copy without .git (default: git describe)",
    )
    return parser


def kernel_run(command: str, args: argparse.Namespace, vllm_what: str, model: str,
               notes: list[str]) -> tuple[dict, dict] | None:  # fmt: skip
    """A kernel bench's first record and its result file's header, or None (said on stderr)
    without a GPU. raw: the GPU, the date and the copy bandwidth measured now; the document:
    `bench ab`'s schema with `bench COMMAND`'s command line, vLLM's version and what it ran."""
    import shlex
    import sys

    import torch

    if not torch.cuda.is_available():
        print(f"bench {command}: needs a CUDA GPU (it times kernels on one)", file=sys.stderr)
        return None
    import vllm

    from hyperqwen.bench.header import git_commit
    from hyperqwen.bench.results import RESULT_SCHEMA

    raw = {
        "gpu": gpu_label(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "copy_gbps": copy_bandwidth_gbps(),
    }
    document = {
        "schema": RESULT_SCHEMA,
        "gpu": raw["gpu"],
        "vllm": f"vLLM {vllm.__version__}: {vllm_what}",
        "commit": args.commit or git_commit(),
        "date": raw["date"],
        "command": shlex.join(["hyperqwen", "bench", command, *sys.argv[3:]]),
        "model": model,
        "notes": notes,
    }
    return raw, document


def copy_row(raw: dict):
    """The copy bandwidth the run's GB/s rows compare with, as a row (the same both sides)."""
    from hyperqwen.bench.results import comparison_row

    copy = round(raw["copy_gbps"])
    return comparison_row("copy_bandwidth", "GB/s", copy, copy)

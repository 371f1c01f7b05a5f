"""Serving the 27B geometry until vLLM has sized its KV cache, and reading what it logged.

Shared by `hyperqwen bench capacity` (bench/capacity_rows.py) and tests/test_capacity_gpu.py:
the synthesized model folders, the GPU_UTIL that pins vLLM's memory to a budget on a larger
card, a server run only until a log line appears, and vLLM 0.26's sizing lines parsed.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from hyperqwen.bench.server_process import stop_group
from hyperqwen.capacity import CUDA_UNREPORTED_BYTES

SRC = Path(__file__).resolve().parents[2]
POLL_S = 2
# vLLM 0.26's lines (kv_cache_utils.py: get_kv_cache_configs; gpu_worker.py:
# determine_available_memory, compile_or_warm_up_model). The "] " of vLLM's logger prefix tells
# its line from the launcher's startup note, which quotes the size it expects vLLM to log.
SIZE_LINE = re.compile(r"\] GPU KV cache size: ([\d,]+) tokens")
CONCURRENCY_LINE = re.compile(r"\] Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")
AVAILABLE_LINE = re.compile(r"Available KV cache memory: ([\d.]+) GiB")
# Logged after CUDA-graph capture, only when GPU_UTIL (not KV_MEM) sizes the pool.
# Non-torch memory is a difference of whole-card readings: below zero when another process
# freed memory during the profiling run.
USAGE_LINE = re.compile(
    r"Actual usage is ([\d.]+) GiB for weight, ([\d.]+) GiB for peak activation, "
    r"(-?[\d.]+) GiB for non-torch memory, and ([\d.]+) GiB for CUDAGraph memory"
)
# vLLM's refusal when max_model_len does not fit the pool it found (kv_cache_utils.py:
# _check_enough_kv_cache_memory): the length asked for and the longest that fits.
TOO_LONG_LINE = re.compile(
    r"max seq len \((\d+)\).*?the estimated maximum model length is (\d+)", re.DOTALL
)
# vLLM's API server lists the flags it was given (entrypoints/serve/utils/api_utils.py): the
# tokens per step where the command sets them; absent, vLLM's default.
STEP_TOKENS_ARG = re.compile(r"non-default args: \{.*?'max_num_batched_tokens': (\d+)")
# Rounds GPU_UTIL down to what `--gpu-memory-utilization` is given with: never over the budget.
UTIL_DECIMALS = 4


def synth_command(folder: Path, prepared: bool) -> list[str]:
    """`hyperqwen synth` of the 27B geometry's config and tokenizer (served with dummy
    weights): the prepared checkpoint with its draft head, or the unprepared base stock serves."""
    command = [sys.executable, "-m", "hyperqwen.cli", "synth", str(folder)]
    command += ["--preset", "27b", "--config-only"]
    return command + (["--prepared", "--draft-head"] if prepared else [])


def gpu_util_for_budget(budget_bytes: float, card_bytes: int) -> float:
    """GPU_UTIL under which vLLM requests `budget_bytes` of a card of `card_bytes`
    (nvidia-smi's memory.total): vLLM multiplies the total CUDA reports, which is
    CUDA_UNREPORTED_BYTES less (worker/utils.py: request_memory)."""
    util = budget_bytes / (card_bytes - CUDA_UNREPORTED_BYTES)
    return math.floor(util * 10**UTIL_DECIMALS) / 10**UTIL_DECIMALS


def package_env() -> dict[str, str]:
    """This environment with this checkout's package first on the path, so `python -m
    hyperqwen.cli` runs it whether installed or not."""
    return {**os.environ, "PYTHONPATH": f"{SRC}:{os.environ.get('PYTHONPATH', '')}"}


def served_until_logged(
    command: list[str], env: dict[str, str], log: Path, done: re.Pattern, timeout_s: float
) -> str:
    """Run a server until its log matches `done` or it exits (or timeout_s passes), then stop
    its process group; its log. The caller reads what it needs (or its absence) from it."""
    with log.open("w") as sink:
        process = subprocess.Popen(
            command,
            env={**package_env(), **env},
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline and process.poll() is None:
                if done.search(log.read_text(errors="replace")):
                    break
                time.sleep(POLL_S)
        finally:
            stop_group(process)
    return log.read_text(errors="replace")


@dataclass(frozen=True)
class VllmSizing:
    """What one vLLM 0.26 server logged about its memory; None: not logged."""

    cache_tokens: int | None  # "GPU KV cache size: N tokens"
    max_len: int | None  # max_model_len the concurrency is for
    concurrency: float | None  # requests of max_len the pool holds at once
    pool_gib: float | None  # "Available KV cache memory": attention KV and GDN state
    weight_gib: float | None
    activation_gib: float | None  # peak activation of the profile run
    non_torch_gib: float | None
    graph_gib: float | None  # CUDA graphs (captured, not the profile's estimate)
    step_tokens: int | None = None  # --max-num-batched-tokens as given; None: vLLM's default

    @property
    def complete(self) -> bool:
        return None not in (self.cache_tokens, self.concurrency, self.pool_gib, self.graph_gib)


def parse_sizing(log: str) -> VllmSizing:
    size, concurrency = SIZE_LINE.search(log), CONCURRENCY_LINE.search(log)
    available, usage = AVAILABLE_LINE.search(log), USAGE_LINE.search(log)
    parts = [float(value) for value in usage.groups()] if usage else [None] * 4
    return VllmSizing(
        cache_tokens=int(size[1].replace(",", "")) if size else None,
        max_len=int(concurrency[1].replace(",", "")) if concurrency else None,
        concurrency=float(concurrency[2]) if concurrency else None,
        pool_gib=float(available[1]) if available else None,
        weight_gib=parts[0],
        activation_gib=parts[1],
        non_torch_gib=parts[2],
        graph_gib=parts[3],
        step_tokens=int(step[1]) if (step := STEP_TOKENS_ARG.search(log)) else None,
    )

"""The API patches cost nothing: stock vs patched vLLM throughput on one GPU host, one run.

Run on the GPU host with `pytest -m gpu`. Stock = $HYPERQWEN_STOCK_VLLM (else the importable
vLLM, which must be unpatched); patched = $HYPERQWEN_PATCHED_VLLM (else a patched copy). Both
serve the same tiny Qwen3.5 checkpoint (config-only, --load-format dummy) with the same flags,
side by side on the one GPU; `vllm bench serve` (random 128 in / 128 out, ignore-eos) measures
C1 and C64 output throughput in eager mode (see below). The patched server runs with
keep-alives on, as users will.

A single pass of each is not a measurement at this resolution: on the first try, one 5-second
C64 pass per side differed by 12 % between two runs of the same build. So both servers stay up
and the passes alternate, ROUNDS per side with the order flipped each round (host drift and
warm caches fall on both alike), and the medians are compared. One client measures both: the
patched tree's `vllm bench serve` (stock's parses the same streams; the keep-alive comments
never fire within these requests).
"""

from __future__ import annotations

import contextlib
import json
import shlex
import statistics
import sys

import pytest
from gpu_server import (
    TRITON_GDN,
    bench_serve,
    log_dir,
    patched_vllm_parent,
    require_gpu,
    running_server,
    stock_vllm_parent,
    with_vllm_first,
)
from local_server import free_port

from hyperqwen.checkpoint.geometry import PRESETS
from hyperqwen.checkpoint.synthesize import synthesize

pytestmark = pytest.mark.gpu

MAX_SLOWDOWN = 0.03
COHORTS = {1: 16, 64: 512}  # concurrency: prompts per pass
ROUNDS = 3


def _server_command(checkpoint, port: int, extra: list[str]) -> list[str]:
    return [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(checkpoint),
        "--served-model-name", "tiny", "--load-format", "dummy", "--language-model-only",
        # Eager mode: no compile wait, and a tiny model's steps become CPU-bound, so any cost
        # the patches add to the serving path shows up undiluted.
        "--enforce-eager",
        # Two servers share the GPU: 0.3 each leaves the second its memory at start-up.
        "--max-model-len", "4096", "--max-num-seqs", "64", "--gpu-memory-utilization", "0.3",
        "--host", "127.0.0.1", "--port", str(port), *shlex.split(TRITON_GDN), *extra,
    ]  # fmt: skip


def test_patched_throughput_matches_stock(tmp_path_factory):
    require_gpu()
    logs = log_dir(tmp_path_factory.mktemp("overhead"))
    checkpoint = synthesize(
        tmp_path_factory.mktemp("tiny") / "tiny", PRESETS["tiny"], config_only=True,
        progress=False,
    ).directory  # fmt: skip
    patched_parent = patched_vllm_parent(tmp_path_factory)
    sides = {
        "stock": (stock_vllm_parent(), []),
        "patched": (patched_parent, ["--sse-keep-alive-interval", "15"]),
    }
    client_env = with_vllm_first(patched_parent)
    runs = {name: {concurrency: [] for concurrency in COHORTS} for name in sides}
    with contextlib.ExitStack() as servers:
        bases = {}
        # One after the other: each profiles its memory while the other is idle.
        for name, (parent, extra) in sides.items():
            port = free_port()
            command = _server_command(checkpoint, port, extra)
            log = logs / f"overhead-{name}-server.log"
            bases[name] = servers.enter_context(
                running_server(command, f"http://127.0.0.1:{port}", log, with_vllm_first(parent))
            )
        for round_index in range(ROUNDS):
            order = list(sides) if round_index % 2 == 0 else list(reversed(sides))
            for name in order:
                for concurrency, prompts in COHORTS.items():
                    result = bench_serve(
                        bases[name], "tiny", checkpoint, client_env,
                        logs / f"overhead-{name}-c{concurrency}-r{round_index}.json",
                        concurrency=concurrency, prompts=prompts,
                    )  # fmt: skip
                    runs[name][concurrency].append(result["output_throughput"])
    table = {}
    for concurrency in COHORTS:
        stock, patched = (statistics.median(runs[name][concurrency]) for name in sides)
        table[concurrency] = {
            "stock": stock,
            "patched": patched,
            "ratio": patched / stock,
            "stock_runs": runs["stock"][concurrency],
            "patched_runs": runs["patched"][concurrency],
        }
    (logs / "overhead-summary.json").write_text(json.dumps(table, indent=1))
    for concurrency, row in table.items():
        assert row["ratio"] >= 1 - MAX_SLOWDOWN, (concurrency, row)

"""The API patches cost nothing: stock vs patched vLLM throughput on one GPU host, one run.

Run on the GPU host with `pytest -m gpu`. Stock = $HYPERQWEN_STOCK_VLLM (else the importable
vLLM, which must be unpatched); patched = $HYPERQWEN_PATCHED_VLLM (else a patched copy). Both
serve the same tiny Qwen3.5 checkpoint (config-only, --load-format dummy) with the same flags;
`vllm bench serve` (random 128 in / 128 out, ignore-eos) measures C1 and C64 output
throughput, in eager mode (see below). The patched server runs with keep-alives on, as users will.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

import pytest
from gpu_server import (
    TRITON_GDN,
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
COHORTS = {1: 16, 64: 256}  # concurrency: prompts


def serve_and_bench(parent, checkpoint, extra: list[str], logs, name: str) -> dict[int, float]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = with_vllm_first(parent)
    command = [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(checkpoint),
        "--served-model-name", "tiny", "--load-format", "dummy", "--language-model-only",
        # Eager mode: no compile wait, and a tiny model's steps become CPU-bound, so any cost
        # the patches add to the serving path shows up undiluted.
        "--enforce-eager",
        "--max-model-len", "4096", "--max-num-seqs", "64", "--gpu-memory-utilization", "0.5",
        "--host", "127.0.0.1", "--port", str(port), *shlex.split(TRITON_GDN), *extra,
    ]  # fmt: skip
    throughput = {}
    with running_server(command, base, logs / f"overhead-{name}-server.log", env):
        for concurrency, prompts in COHORTS.items():
            result = logs / f"overhead-{name}-c{concurrency}.json"
            bench = [
                sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve",
                "--backend", "vllm", "--base-url", base, "--model", "tiny",
                "--tokenizer", str(checkpoint), "--dataset-name", "random",
                "--random-input-len", "128", "--random-output-len", "128", "--ignore-eos",
                "--num-prompts", str(prompts), "--max-concurrency", str(concurrency),
                "--seed", "0", "--save-result", "--result-dir", str(result.parent),
                "--result-filename", result.name,
            ]  # fmt: skip
            subprocess.run(bench, env=env, check=True, capture_output=True, timeout=400)
            throughput[concurrency] = json.loads(result.read_text())["output_throughput"]
    return throughput


def test_patched_throughput_matches_stock(tmp_path_factory):
    require_gpu()
    logs = log_dir(tmp_path_factory.mktemp("overhead"))
    checkpoint = synthesize(
        tmp_path_factory.mktemp("tiny") / "tiny", PRESETS["tiny"], config_only=True,
        progress=False,
    ).directory  # fmt: skip
    stock = serve_and_bench(stock_vllm_parent(), checkpoint, [], logs, "stock")
    patched = serve_and_bench(
        patched_vllm_parent(tmp_path_factory), checkpoint,
        ["--sse-keep-alive-interval", "15"], logs, "patched",
    )  # fmt: skip
    table = {c: {"stock": stock[c], "patched": patched[c], "ratio": patched[c] / stock[c]}
             for c in COHORTS}  # fmt: skip
    (logs / "overhead-summary.json").write_text(json.dumps(table, indent=1))
    for concurrency, row in table.items():
        assert row["ratio"] >= 1 - MAX_SLOWDOWN, (concurrency, row)

"""On the GPU host: the step map of the served 27B single profile (issue 27, item 1).

The prepared 27B geometry (`synth --preset 27b --config-only --prepared --draft-head`) served
by `hyperqwen serve single` with dummy weights, the Triton GDN prefill and vLLM's torch profiler
(`bench stepmap --server-flags`); then `hyperqwen bench stepmap` maps STEPS decode steps of one
C1 request, with the copy bandwidth measured in its own process. The result file, the table,
the server log and the trace land in $HYPERQWEN_TEST_LOGS (e.g. the device tool's $OUT):
stepmap.json, stepmap.txt, stepmap-server.log, stepmap-trace.json.gz; `bench stepmap --trace
... --model-dir ...` maps the trace again anywhere.
Run: `HYPERQWEN_TEST_LOGS=$OUT pytest -m gpu tests/test_bench_stepmap_gpu.py` (about 6 min:
the server's cold start is most of it).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys

import pytest
from gpu_server import (
    COMMAND_TIMEOUT_S,
    ROOT,
    TRITON_GDN,
    hyperqwen_server,
    log_dir,
    patched_vllm_parent,
    require_gpu,
    with_vllm_first,
)

from hyperqwen.bench.stepmap_cli import server_flags

pytestmark = pytest.mark.gpu

STEPS = 24
PORT = "18073"


def test_stepmap_of_the_served_27b_single_profile(tmp_path_factory, tmp_path):
    require_gpu()
    models = tmp_path_factory.mktemp("models")
    synth = [sys.executable, "-m", "hyperqwen.cli", "synth", str(models / "q27p")]
    synth += ["--preset", "27b", "--config-only", "--prepared", "--draft-head"]
    subprocess.run(synth, check=True, timeout=300, capture_output=True)
    logs = log_dir(tmp_path)
    trace_dir = tmp_path / "trace"
    # the patched vLLM first, the environment's packages (e.g. the GPU kit's) kept behind it
    patched = with_vllm_first(patched_vllm_parent(tmp_path_factory))["PYTHONPATH"]
    pythonpath = os.pathsep.join([str(ROOT / "src"), patched])
    profiler = shlex.join(server_flags(trace_dir, STEPS))
    knobs = {
        "MODELS_DIR": str(models),
        "MODEL": "q27p",
        "PORT": PORT,
        "TOOLS": "0",
        "GPU_UTIL": "0.45",  # leaves room for the bench's 8 GiB copy-bandwidth measurement
        "EXTRA_ARGS": f"--load-format dummy {TRITON_GDN} {profiler}",
        "PYTHONPATH": pythonpath,
    }
    out = logs / "stepmap.json"
    with hyperqwen_server("single", knobs, logs / "stepmap-server.log") as base:
        command = [sys.executable, "-m", "hyperqwen.cli", "bench", "stepmap", "--url", base]
        command += ["--trace-dir", str(trace_dir), "--steps", str(STEPS), "--out", str(out)]
        done = subprocess.run(
            command,
            env={**os.environ, "PYTHONPATH": pythonpath},
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT_S,
            check=False,
        )
    (logs / "stepmap.txt").write_text(done.stdout + done.stderr)
    assert done.returncode == 0, done.stderr[-3000:]
    document = json.loads(out.read_text())
    shutil.copy(document["trace"], logs / "stepmap-trace.json.gz")
    summary = document["stepmap"]
    rows = {row["name"]: row["patched"] for row in document["rows"]}
    # MTP with 3 drafts: every decode step verifies 4 tokens
    assert summary["steps_by_tokens"] == {"4": summary["steps"]}, summary["steps_by_tokens"]
    assert summary["steps"] >= STEPS // 2
    # every forward's weight-only GEMMs are the 64 layers' 256 and the int8 lm_head, in order
    assert summary["forward_gemms_expected"] == 257
    assert summary["gemm_order_matched_steps"] == summary["steps"], summary["classes"]
    assert rows["body_bw_fraction_m4"] is not None and rows["copy_bandwidth"] > 0

"""`hyperqwen bench quoting-ceiling` against real stock vLLM 0.26.0 servers on the GPU host
(`pytest -m gpu`): the mechanism, not the 27B's numbers (bench/README.md has those commands).

The tiny Qwen3.5 geometry (config-only, --load-format dummy, eager: a start in about a minute)
serves k0, k3, k15 and mtp-k3 at once. The command exits 0 only where vLLM's own spec-decode
counters show, for every pass, k drafts per drafting step, every draft accepted and one drafting
step per decode step: what FixedDrafts through vLLM's custom_class seam and synthetic acceptance
at 1.0 must give, and what only a real vLLM can show (the CPU tests run a stand-in).
Stock vLLM: $HYPERQWEN_STOCK_VLLM (e.g. /tmp/gpu-kit/vllm-stock), else the importable one.
"""

from __future__ import annotations

import json
import os
import shlex
import sys

import pytest
from gpu_server import ROOT, log_dir, require_gpu, run_logged, stock_vllm_parent, with_vllm_first

from hyperqwen.bench.quoting_ceiling_run import step_figures
from hyperqwen.checkpoint.geometry import PRESETS
from hyperqwen.checkpoint.synthesize import synthesize

pytestmark = pytest.mark.gpu

CONFIGS = ("k0", "k3", "k15", "mtp-k3")
FLAGS = (
    "--load-format dummy --language-model-only --enforce-eager --max-model-len 4096 "
    "--max-num-seqs 8 --gpu-memory-utilization 0.15 --kv-cache-memory-bytes 2000000000 "
    "--gdn-prefill-backend triton"
)


def test_every_step_verifies_k_plus_1_on_real_vllm(tmp_path_factory) -> None:
    require_gpu()
    logs = log_dir(tmp_path_factory.mktemp("ceiling"))
    checkpoint = synthesize(
        tmp_path_factory.mktemp("tiny") / "tiny", PRESETS["tiny"], config_only=True,
        progress=False,
    ).directory  # fmt: skip
    stock = stock_vllm_parent()
    env = with_vllm_first(stock)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env["PYTHONPATH"]])  # FixedDrafts
    out = logs / "ceiling-tiny.json"
    command = [
        sys.executable, "-m", "hyperqwen.cli", "bench", "quoting-ceiling", str(checkpoint),
        "--stock-vllm", str(stock), "--configs", ",".join(CONFIGS), "--start-together",
        "--workdir", str(logs / "ceiling-work"), f"--vllm-args={FLAGS}", "--out", str(out),
    ]  # fmt: skip
    printed = run_logged(command, env, logs / "ceiling-tiny.log")
    document = json.loads(out.read_text())
    assert list(document["configs"]) == list(CONFIGS), printed
    for name, record in document["configs"].items():
        figures = step_figures(record)
        assert figures.refused is None and figures.step_ms, (name, figures)
        for measured in record["passes"]:
            expected = None if name == "k0" else record["drafts"] + 1
            assert measured["row"]["tokens_per_step"] == expected, (name, measured["row"])
        assert "--no-async-scheduling" in record["command"], shlex.join(record["command"])

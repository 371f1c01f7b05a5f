"""Soak of the real `hyperqwen serve` (issue 14, item 2): HYPERQWEN_SOAK_MINUTES (default 10) of
`hyperqwen bench soak`'s mixed traffic against the single and the batch profile, a synthetic
model with dummy weights (HYPERQWEN_SOAK_PRESET: tiny by default, 27b for the flagship's
geometry), with a key. Nothing may be lost or answered unexpectedly; the API
process's RSS must not grow after warm-up by more than the bound below, nor the server's GPU
memory by more than the activation peak vLLM profiled at startup and left out of its KV pool
(its log says how much): vLLM empties PyTorch's cache after that profile, so the first batches
that reach a new peak take some of it back in one step, which is not a leak; growth past it is
memory vLLM did not budget for. Reports: $HYPERQWEN_TEST_LOGS/soak-MODE.json (for
docs/reliability.md).

Run: `pytest -m gpu tests/test_soak_gpu.py`. The two modes may soak side by side on one GPU, in
two pytest processes (`-k single`, `-k batch`) with HYPERQWEN_SOAK_SIDE_BY_SIDE=1: GPU memory is
then counted per server process tree, which needs nvidia-smi to list those processes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from gpu_server import hyperqwen_server, log_dir, require_gpu, started_server
from test_serve_gpu import serve_env

from hyperqwen.bench.client import BenchClient
from hyperqwen.bench.run import served_model
from hyperqwen.bench.soak import Target, profiled_activation_mib, soak

pytestmark = pytest.mark.gpu

KEY = "soak-test-key"
MINUTES = float(os.environ.get("HYPERQWEN_SOAK_MINUTES", "10"))
SIDE_BY_SIDE = os.environ.get("HYPERQWEN_SOAK_SIDE_BY_SIDE") == "1"
PRESET = os.environ.get("HYPERQWEN_SOAK_PRESET", "tiny")
SLOTS = {"single": 4, "batch": 16}
RSS_GROWTH_MIB = 256  # the API process after warm-up


@pytest.fixture(scope="module")
def soak_models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A MODELS_DIR holding the PRESET geometry (config and tokenizer; dummy weights)."""
    from hyperqwen.checkpoint.geometry import PRESETS
    from hyperqwen.checkpoint.synthesize import synthesize

    require_gpu()
    if PRESET not in PRESETS:
        pytest.fail(f"HYPERQWEN_SOAK_PRESET={PRESET!r}: not one of {', '.join(PRESETS)}")
    root = tmp_path_factory.mktemp("models")
    synthesize(root / PRESET, PRESETS[PRESET], config_only=True, progress=False)
    return root


@pytest.mark.parametrize(("mode", "port"), [("single", 18051), ("batch", 18052)])
def test_soak_loses_nothing_and_memory_stays_in_vllms_budget(soak_models_dir, tmp_path, mode, port):
    side = {"GPU_UTIL": "0.4"} if SIDE_BY_SIDE else {}  # two servers' shares of one GPU
    env = serve_env(
        soak_models_dir,
        MODEL=PRESET,
        PORT=str(port),
        VLLM_API_KEY=KEY,
        MAX_SEQS=str(SLOTS[mode]),
        **side,
    )
    log = log_dir(tmp_path) / f"soak-{mode}-server.log"
    with hyperqwen_server(mode, env, log, started_server) as process:
        base = f"http://127.0.0.1:{port}"
        model, max_model_len = served_model(BenchClient(base, KEY), PRESET)
        target = Target(base, KEY, model, max_model_len, timeout_s=120)
        report = soak(
            target, MINUTES * 60, 2 * SLOTS[mode], SLOTS[mode], warmup_s=60, api_pid=process.pid
        )
        assert process.poll() is None, "the server died during the soak"
    budget_mib = profiled_activation_mib(log.read_text(errors="replace"))
    report.update(mode=mode, minutes=MINUTES, preset=PRESET, gpu_growth_budget_mib=budget_mib)
    (log_dir(tmp_path) / f"soak-{mode}.json").write_text(json.dumps(report, indent=1))
    assert report["totals"]["lost"] == 0, report
    assert report["unexpected"] == {}, report
    start, end = report["memory_after_warmup"], report["memory_at_end"]
    if SIDE_BY_SIDE:
        assert start["gpu_scope"] == "server processes", (
            "nvidia-smi does not list this server's processes, so the other soak's memory would "
            "count too: run the modes one after another (without HYPERQWEN_SOAK_SIDE_BY_SIDE)"
        )
    assert end["api_rss_mib"] - start["api_rss_mib"] < RSS_GROWTH_MIB, report
    assert budget_mib is not None, f"{log}: no 'GiB for peak activation' line from vLLM"
    assert end["gpu_used_mib"] - start["gpu_used_mib"] < budget_mib, report

"""A prepared checkpoint served by the patched vLLM on a GPU, with MTP speculative decoding: the
int8 lm_head, embedding and MTP head load into vLLM's real kernels (Machete/Marlin, the Triton
embedding gather) and the server answers, drafting with the int8 MTP head.

Run on the GPU host: `pytest -m gpu tests/test_prepare_gpu.py` (logs in $HYPERQWEN_TEST_LOGS).
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import sys

import pytest
import requests
from gpu_server import (
    TRITON_GDN,
    log_dir,
    patched_vllm_parent,
    require_gpu,
    running_server,
    with_vllm_first,
)
from local_server import free_port
from test_prepare_common import ROOT, run_prepare

from hyperqwen.checkpoint.geometry import PRESETS
from hyperqwen.checkpoint.synthesize import synthesize
from hyperqwen.patches import PatchState, apply_series, check_series, load_series

pytestmark = pytest.mark.gpu
PATCH = "embed-quant.patch"


def _with_embed_quant(parent, tmp_path):
    """The patched tree, with embed-quant.patch on top while the series does not list it yet."""
    series_dir = tmp_path / "embed-quant-series"
    series_dir.mkdir()
    shutil.copy(ROOT / "patches" / PATCH, series_dir / PATCH)
    (series_dir / "series").write_text(PATCH + "\n")
    series = load_series(series_dir)
    if check_series(series, parent / "vllm")[0].state != PatchState.APPLIED:
        apply_series(series, parent / "vllm")
    return parent


def test_vllm_serves_a_prepared_checkpoint_with_int8_head_embedding_and_mtp(
    tmp_path, tmp_path_factory
):
    require_gpu()
    parent = _with_embed_quant(patched_vllm_parent(tmp_path_factory), tmp_path)
    model = tmp_path / "tiny"
    synthesize(model, PRESETS["tiny"], progress=False)
    code, out, err = run_prepare(str(model), "--quiet")
    assert code == 0, err + out
    port = free_port()
    command = [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model),
        "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
        "--language-model-only", "--enforce-eager", "--max-model-len", "2048",
        "--gpu-memory-utilization", "0.2",
        "--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": 2}),
        *shlex.split(TRITON_GDN),
    ]  # fmt: skip
    log = log_dir(tmp_path) / "prepare_gpu_vllm.log"
    with running_server(command, f"http://127.0.0.1:{port}", log, with_vllm_first(parent)) as base:
        response = requests.post(
            f"{base}/v1/chat/completions",
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": "Count to ten."}],
                "max_tokens": 32,
                "min_tokens": 32,
                "temperature": 0,
                "chat_template_kwargs": {"enable_thinking": False},
            },
            timeout=120,
        )
        metrics = requests.get(f"{base}/metrics", timeout=30).text
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 32
    drafted = re.search(
        r"^vllm:spec_decode_num_draft_tokens_total\{[^}]*\} ([\d.e+]+)", metrics, re.M
    )
    assert drafted and float(drafted.group(1)) > 0, "the MTP head drafted nothing"

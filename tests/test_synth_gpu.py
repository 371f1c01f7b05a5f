"""A synthesized tiny checkpoint is served by plain `vllm serve` from its files and answers.

Run on the GPU host: `pytest -m gpu tests/test_synth_gpu.py`. The server log is kept in
$HYPERQWEN_TEST_LOGS when set (else the test's tmp dir).
"""

import os
import shlex
import sys
from pathlib import Path

import pytest
import requests
import torch
from gpu_server import TRITON_GDN, running_server
from local_server import free_port

from hyperqwen.checkpoint.geometry import PRESETS
from hyperqwen.checkpoint.synthesize import synthesize

pytestmark = pytest.mark.gpu


def vllm_server(model_dir: Path, log: Path):
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        str(model_dir),
        "--served-model-name",
        "tiny",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--language-model-only",
        "--enforce-eager",
        "--max-model-len",
        "2048",
        # a tiny model needs little memory; the rest of the GPU stays free for other servers
        "--gpu-memory-utilization",
        "0.2",
        *shlex.split(TRITON_GDN),
    ]
    return running_server(command, f"http://127.0.0.1:{port}", log)


def test_vllm_serves_the_tiny_checkpoint_from_files(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model_dir = tmp_path / "tiny"
    synthesize(model_dir, PRESETS["tiny"], progress=False)
    log = Path(os.environ.get("HYPERQWEN_TEST_LOGS", tmp_path)) / "synth_gpu_vllm.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with vllm_server(model_dir, log) as base:
        response = requests.post(
            f"{base}/v1/chat/completions",
            json={
                "model": "tiny",
                "messages": [
                    {"role": "system", "content": "You are terse."},
                    {"role": "user", "content": "Say something."},
                ],
                "max_tokens": 16,
                "min_tokens": 16,
                "temperature": 0,
                "chat_template_kwargs": {"enable_thinking": False},
            },
            timeout=120,
        )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["usage"]["completion_tokens"] == 16
    assert body["usage"]["prompt_tokens"] > 10
    content = body["choices"][0]["message"]["content"]
    assert isinstance(content, str) and content.strip()

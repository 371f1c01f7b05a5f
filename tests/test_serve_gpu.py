"""On the GPU host: `hyperqwen serve single|batch` really serves a tiny Qwen3.5 model and chats.

The model is config + the real Qwen3.5 tokenizer (`hyperqwen synth --config-only`) with random
weights from vLLM's `--load-format dummy`, passed through EXTRA_ARGS like a user would.
"""

from __future__ import annotations

import json

import pytest
import requests
from gpu_server import TRITON_GDN, chat, hyperqwen_server, log_dir

pytestmark = pytest.mark.gpu


def serve_env(tiny_models_dir, **knobs: str) -> dict[str, str]:
    return {
        "MODELS_DIR": str(tiny_models_dir),
        "MODEL": "tiny",
        "GPU_UTIL": "0.5",
        "EXTRA_ARGS": f"--load-format dummy --max-model-len 4096 {TRITON_GDN}",
        **knobs,
    }


def test_single_serves_with_mtp_and_enforces_the_key(tiny_models_dir, tmp_path):
    env = serve_env(tiny_models_dir, VLLM_API_KEY="gpu-test-key", PORT="18031")
    with hyperqwen_server("single", env, log_dir(tmp_path) / "serve-single.log") as base:
        assert requests.get(f"{base}/v1/models", timeout=10).status_code == 401
        models = requests.get(
            f"{base}/v1/models", timeout=10, headers={"Authorization": "Bearer gpu-test-key"}
        ).json()
        assert [m["id"] for m in models["data"]] == ["tiny"]
        answer = chat(base, "tiny", key="gpu-test-key")
        (log_dir(tmp_path) / "chat-single.json").write_text(json.dumps(answer, indent=1))
        assert answer["usage"]["completion_tokens"] > 0
        metrics = requests.get(
            f"{base}/metrics", timeout=10, headers={"Authorization": "Bearer gpu-test-key"}
        ).text
        assert "vllm:spec_decode_num_drafts" in metrics  # MTP speculation is running
    log = (log_dir(tmp_path) / "serve-single.log").read_text()
    assert "gpu-test-key" not in log and "VLLM_API_KEY: set (12 chars)" in log


def test_batch_serves_concurrent_chats(tiny_models_dir, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    env = serve_env(tiny_models_dir, PORT="18032")
    with hyperqwen_server("batch", env, log_dir(tmp_path) / "serve-batch.log") as base:
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda _: chat(base, "tiny"), range(8)))
        (log_dir(tmp_path) / "chat-batch.json").write_text(json.dumps(answers[0], indent=1))
        assert all(a["usage"]["completion_tokens"] > 0 for a in answers)
        # --enable-prompt-tokens-details: clients see how much came from the prefix cache.
        assert answers[0]["usage"]["prompt_tokens_details"] is not None

"""Prefix caching with and without the overlap (PREFIX_CACHE_OVERLAP) on a GPU: same tokens.

The tiny synthetic checkpoint is served twice with prefix caching and MTP k=3 at high synthetic
acceptance (so drafts are accepted across the small mamba blocks' boundaries, and both the
overlapped and vLLM's waiting steps occur), once with HYPERQWEN_ALIGN_OVERLAP=1. A state slot
or block taken wrongly changes what the model computes from then on, so every continuation must
be the same token ids. The overlapped server must log that it skipped a wait.

Run on the GPU host: `pytest -m gpu tests/test_engine_align_overlap_gpu.py`.
"""

from __future__ import annotations

import json

import pytest
from gpu_server import (
    complete,
    log_dir,
    patched_vllm_parent,
    require_gpu,
    running_server,
    with_vllm_first,
)
from local_server import free_port
from test_prepare_gpu import PROMPTS, tiny_server

from hyperqwen.checkpoint.geometry import PRESETS
from hyperqwen.checkpoint.synthesize import synthesize
from hyperqwen.engine.features import ALIGN_OVERLAP

pytestmark = pytest.mark.gpu

SPECULATION = {
    "method": "mtp",
    "num_speculative_tokens": 3,
    "rejection_sample_method": "synthetic",
    "synthetic_acceptance_rates": [0.9, 0.8, 0.7],
}
TOKENS = 300


def continuations(base: str) -> dict[str, list[int]]:
    out = {}
    for prompt in PROMPTS:
        choice = complete(base, prompt, max_tokens=TOKENS, min_tokens=TOKENS, return_token_ids=True)
        out[prompt] = choice["token_ids"]
    return out


def test_overlap_changes_no_token(tmp_path, tmp_path_factory):
    require_gpu()
    logs = log_dir(tmp_path)
    base_env = with_vllm_first(patched_vllm_parent(tmp_path_factory))
    model = synthesize(tmp_path / "tiny", PRESETS["tiny"], progress=False).directory
    results, server_logs = {}, {}
    for overlap in ("0", "1"):
        port = free_port()
        log = logs / f"align-overlap-{overlap}-server.log"
        command = [*tiny_server(model, port, SPECULATION), "--enable-prefix-caching"]
        env = {**base_env, ALIGN_OVERLAP.env: overlap}
        with running_server(command, f"http://127.0.0.1:{port}", log, env) as url:
            results[overlap] = continuations(url)
        server_logs[overlap] = log.read_text()
    (logs / "align-overlap-summary.json").write_text(json.dumps(results))
    assert "align overlap: a step prepared without waiting" in server_logs["1"]
    assert "align overlap" not in server_logs["0"]
    for prompt in PROMPTS:
        assert len(results["1"][prompt]) == TOKENS
        assert results["1"][prompt] == results["0"][prompt], prompt

"""KV=kvarn in a real vLLM server: the tiny synthetic Qwen3.5 (head_dim 256, 2 KV heads, as
`hyperqwen synth` makes it) served twice, with vLLM's bf16 cache (KV=auto) and with KVarN's
backend the way the launcher selects it (HYPERQWEN_KV_KVARN=1, `--attention-backend CUSTOM`,
cache dtype auto), both without speculation and with a fixed KV budget (KV=kvarn's side cache
lies outside it: kvarn/backend.py). Each answers greedily a prompt of a few hundred tokens, so
its prefill stores and reads tile 1 and its decode fills tiles 2 and 3 (kvarn/attention.py).

Checked: the server starts (the plugin registered the backend, the attention_kv_spec seam sized
its pages beside the GDN layers' state), and the greedy continuation is KV=auto's up to the
first step whose top-2 margin is below NEAR_TIE: a 4-bit K / 2-bit V cache changes the logits a
little, so a close call may go the other way, a wrong read (a tile in the wrong block, a token
lost) changes them a lot. The agreeing prefix and margins go to
$HYPERQWEN_TEST_LOGS/kvarn-serve-summary.json.

Run on the GPU host: `pytest -m gpu tests/test_kvarn_serve_gpu.py` (two tiny servers, one after
the other).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys

import pytest
from cli_runner import ROOT
from gpu_server import (
    TRITON_GDN,
    agreeing_prefix,
    complete,
    log_dir,
    patched_vllm_parent,
    require_gpu,
    running_server,
    top2_margins,
)
from local_server import free_port
from test_prepare_common import run_prepare

from hyperqwen.checkpoint.geometry import PRESETS
from hyperqwen.checkpoint.synthesize import synthesize
from hyperqwen.engine.features import KVARN
from hyperqwen.kv_choices import KV_CHOICES

pytestmark = pytest.mark.gpu

ANSWER_TOKENS = 200
# the KV pool's bytes; KVarN's side cache (about 5x the pool at head_dim 256) comes on top
KV_BYTES = "1G"
NEAR_TIE = 0.5
PROMPT = " ".join(
    f"Station {i} reports wind from the {d} at {10 + i} knots and a pressure of {990 + i} hPa."
    for i, d in enumerate(["north", "east", "south", "west"] * 5)
)  # a few hundred tokens


def server(model, port: int, kv: str) -> list[str]:
    choice = KV_CHOICES[kv]
    backend_flags = [f"{flag}={value}" for flag, value in choice.launch_flags()]
    return [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model),
        "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
        "--language-model-only", "--max-model-len", "2048", "--max-num-seqs", "2",
        "--kv-cache-memory-bytes", KV_BYTES, "--seed", "0",
        "--kv-cache-dtype", choice.vllm_cache_dtype, *backend_flags, *shlex.split(TRITON_GDN),
    ]  # fmt: skip


def test_kvarn_serves_kv_autos_greedy_text_up_to_near_ties(tmp_path, tmp_path_factory):
    require_gpu()
    logs = log_dir(tmp_path)
    parent = patched_vllm_parent(tmp_path_factory)
    src = ROOT / "src"
    model = tmp_path / "tiny-prepared"
    shutil.copytree(synthesize(tmp_path / "tiny", PRESETS["tiny"], progress=False).directory, model)
    code, out, err = run_prepare(str(model), "--quiet")
    assert code == 0, err + out

    results = {}
    for kv in ("auto", "kvarn"):
        port = free_port()
        env = {**os.environ, "PYTHONPATH": f"{parent}:{src}"}
        env.pop(KVARN.env, None)
        if kv == "kvarn":
            env[KVARN.env] = "1"
        log = logs / f"kvarn-serve-{kv}-server.log"
        with running_server(server(model, port, kv), f"http://127.0.0.1:{port}", log, env) as url:
            choice = complete(
                url, PROMPT, max_tokens=ANSWER_TOKENS, min_tokens=ANSWER_TOKENS, logprobs=2,
                return_token_ids=True,
            )  # fmt: skip
            results[kv] = {
                "prompt_tokens": len(choice.get("prompt_token_ids") or []),
                "greedy_ids": choice["token_ids"],
                "margins": top2_margins(choice),
            }
        if kv == "kvarn":
            assert "Using AttentionBackendEnum.CUSTOM backend" in log.read_text()

    agreed, at_near_tie = agreeing_prefix(results["auto"], results["kvarn"], NEAR_TIE)
    summary = {"agreeing_prefix": agreed, "differs_at_near_tie": at_near_tie, **results}
    (logs / "kvarn-serve-summary.json").write_text(json.dumps(summary, indent=1))
    assert results["auto"]["prompt_tokens"] > 256, "the prompt must fill tiles 0 and 1"
    assert at_near_tie, f"greedy output differs at token {agreed} where KV=auto was sure"

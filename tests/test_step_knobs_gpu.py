"""MODEL_RUNNER=v2 and INDUCTOR_PDL=1 on a GPU: the same tokens as vLLM's V1 runner without them.

The tiny synthetic checkpoint is served compiled (CUDA graphs, torch.compile: what both knobs
change) with prefix caching and MTP k=3 at high synthetic acceptance (the prefix-caching
overlap test's speculation and continuations), three times: vLLM's V1 runner, the V2 runner
(VLLM_USE_V2_MODEL_RUNNER=1, what MODEL_RUNNER=v2 sets), and Inductor's kernels with
programmatic dependent launch (the compilation config INDUCTOR_PDL=1 passes). Every
continuation must be the same token ids; each server must show its knob took effect (the V2
runner's log line; Inductor's wait instruction in the kernels it generated, and none without).

Run on the GPU host: `pytest -m gpu tests/test_step_knobs_gpu.py`.
"""

from __future__ import annotations

import json

import pytest
from gpu_server import log_dir, patched_vllm_parent, require_gpu, running_server, with_vllm_first
from local_server import free_port
from test_engine_align_overlap_gpu import SPECULATION, TOKENS, continuations
from test_prepare_gpu import PROMPTS, tiny_server

from hyperqwen.checkpoint.geometry import PRESETS
from hyperqwen.checkpoint.synthesize import synthesize
from hyperqwen.launch import RUNNER_ENV, RUNNER_ENV_VALUES, compilation_config

pytestmark = pytest.mark.gpu

GRAPH_TOKENS = 64
V2_LOG_LINE = "Using V2 Model Runner"  # vllm/v1/worker/gpu_worker.py
GDC_WAIT = "gdc_wait"  # what Inductor writes into a Triton kernel with PDL on


def compiled_server(model, port: int, inductor_pdl: bool, speculative=SPECULATION) -> list[str]:
    """tiny_server's command, compiled as the launcher compiles (no --enforce-eager), with
    prefix caching."""
    command = [word for word in tiny_server(model, port, speculative) if word != "--enforce-eager"]
    config = compilation_config(GRAPH_TOKENS, inductor_pdl)
    return [*command, "--enable-prefix-caching", "--compilation-config", json.dumps(config)]


def generated_kernels_wait(cache_root) -> bool:
    return any(GDC_WAIT in path.read_text(errors="replace") for path in cache_root.rglob("*.py"))


def test_v2_runner_and_inductor_pdl_change_no_token(tmp_path, tmp_path_factory):
    require_gpu()
    logs = log_dir(tmp_path)
    base_env = with_vllm_first(patched_vllm_parent(tmp_path_factory))
    model = synthesize(tmp_path / "tiny", PRESETS["tiny"], progress=False).directory
    setups = {
        "v1": ({RUNNER_ENV: RUNNER_ENV_VALUES["v1"]}, False),
        "v2": ({RUNNER_ENV: RUNNER_ENV_VALUES["v2"]}, False),
        "inductor-pdl": ({RUNNER_ENV: RUNNER_ENV_VALUES["v1"]}, True),
    }
    tokens, server_logs, waits = {}, {}, {}
    for name, (variables, inductor_pdl) in setups.items():
        port = free_port()
        log = logs / f"step-knobs-{name}-server.log"
        cache = tmp_path / f"cache-{name}"
        env = {**base_env, **variables, "VLLM_CACHE_ROOT": str(cache)}
        command = compiled_server(model, port, inductor_pdl)
        with running_server(command, f"http://127.0.0.1:{port}", log, env) as url:
            tokens[name] = continuations(url)
        server_logs[name] = log.read_text()
        waits[name] = generated_kernels_wait(cache)
    (logs / "step-knobs-summary.json").write_text(json.dumps({"tokens": tokens, "waits": waits}))
    assert V2_LOG_LINE in server_logs["v2"]
    assert V2_LOG_LINE not in server_logs["v1"]
    assert waits == {"v1": False, "v2": False, "inductor-pdl": True}
    for prompt in PROMPTS:
        assert len(tokens["v1"][prompt]) == TOKENS
        assert tokens["v2"][prompt] == tokens["v1"][prompt], f"v2: {prompt}"
        assert tokens["inductor-pdl"][prompt] == tokens["v1"][prompt], f"inductor-pdl: {prompt}"

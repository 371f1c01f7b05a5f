"""MODEL_RUNNER=v2 and INDUCTOR_PDL=1 on a GPU: the answers of vLLM's V1 runner without them.

The tiny synthetic checkpoint is served compiled (CUDA graphs, torch.compile: what both knobs
change) with prefix caching and MTP k=3 under real verification, so every answer is the
target's greedy continuation, three times: vLLM's V1 runner, the V2 runner
(VLLM_USE_V2_MODEL_RUNNER=1, what MODEL_RUNNER=v2 sets), and Inductor's kernels with
programmatic dependent launch (the compilation config INDUCTOR_PDL=1 passes). PDL changes only
when a kernel starts, never what it computes: its answers and prompt log-probabilities must be
V1's exactly. The V2 runner builds the step's inputs its own way, so its answers must agree up
to the first near tie (test_prepare_gpu's NEAR_TIE) and its log-probabilities within its
tolerance. Each server must show its knob took effect (the V2 runner's log line; Inductor's
wait instruction in the kernels it generated, and none without).

Synthetic acceptance would not do here: it accepts drafts by a random draw, so two runners that
draw in another order answer differently (the first H100 run, 2026-12-05, bench/measurements/
2026-12-05-h100-step-knobs.json, diverged within 5 tokens that way).

Run on the GPU host: `pytest -m gpu tests/test_step_knobs_gpu.py`.
"""

from __future__ import annotations

import json

import pytest
from gpu_server import (
    agreeing_prefix,
    log_dir,
    patched_vllm_parent,
    require_gpu,
    running_server,
    with_vllm_first,
)
from local_server import free_port
from test_prepare_gpu import NEAR_TIE, PROMPTS, assert_logprobs_agree, observe, tiny_server

from hyperqwen.checkpoint.geometry import PRESETS
from hyperqwen.checkpoint.synthesize import synthesize
from hyperqwen.launch import RUNNER_ENV, RUNNER_ENV_VALUES, compilation_config

pytestmark = pytest.mark.gpu

GRAPH_TOKENS = 64
V2_LOG_LINE = "Using V2 Model Runner"  # vllm/v1/worker/gpu_worker.py
GDC_WAIT = "gdc_wait"  # what Inductor writes into a Triton kernel with PDL on
# real verification (not synthetic acceptance): the output is the target's greedy continuation
MTP3 = {"method": "mtp", "num_speculative_tokens": 3}


def compiled_server(model, port: int, inductor_pdl: bool, speculative: dict) -> list[str]:
    """tiny_server's command, compiled as the launcher compiles (no --enforce-eager), with
    prefix caching."""
    command = [word for word in tiny_server(model, port, speculative) if word != "--enforce-eager"]
    config = compilation_config(GRAPH_TOKENS, inductor_pdl)
    return [*command, "--enable-prefix-caching", "--compilation-config", json.dumps(config)]


def generated_kernels_wait(cache_root) -> bool:
    return any(GDC_WAIT in path.read_text(errors="replace") for path in cache_root.rglob("*.py"))


def test_v2_runner_and_inductor_pdl_answer_as_v1(tmp_path, tmp_path_factory):
    require_gpu()
    logs = log_dir(tmp_path)
    base_env = with_vllm_first(patched_vllm_parent(tmp_path_factory))
    model = synthesize(tmp_path / "tiny", PRESETS["tiny"], progress=False).directory
    setups = {
        "v1": ({RUNNER_ENV: RUNNER_ENV_VALUES["v1"]}, False),
        "v2": ({RUNNER_ENV: RUNNER_ENV_VALUES["v2"]}, False),
        "inductor-pdl": ({RUNNER_ENV: RUNNER_ENV_VALUES["v1"]}, True),
    }
    results, server_logs, waits = {}, {}, {}
    for name, (variables, inductor_pdl) in setups.items():
        port = free_port()
        log = logs / f"step-knobs-{name}-server.log"
        cache = tmp_path / f"cache-{name}"
        env = {**base_env, **variables, "VLLM_CACHE_ROOT": str(cache)}
        command = compiled_server(model, port, inductor_pdl, speculative=MTP3)
        with running_server(command, f"http://127.0.0.1:{port}", log, env) as url:
            results[name] = observe(url)
        server_logs[name] = log.read_text()
        waits[name] = generated_kernels_wait(cache)
    reference = results["v1"]["prompts"]
    v2_agreement = {
        prompt: agreeing_prefix(reference[prompt], results["v2"]["prompts"][prompt], NEAR_TIE)
        for prompt in PROMPTS
    }
    summary = {"results": results, "waits": waits, "v2_agreement": v2_agreement}
    (logs / "step-knobs-summary.json").write_text(json.dumps(summary, indent=1))

    assert V2_LOG_LINE in server_logs["v2"]
    assert V2_LOG_LINE not in server_logs["v1"]
    assert waits == {"v1": False, "v2": False, "inductor-pdl": True}
    assert all(results[name]["drafted"] > 0 for name in setups)  # verify steps ran
    for prompt in PROMPTS:
        assert results["inductor-pdl"]["prompts"][prompt] == reference[prompt], prompt
        candidate = results["v2"]["prompts"][prompt]
        assert_logprobs_agree(reference[prompt], candidate, f"v2: {prompt}")
        agreed, at_near_tie = v2_agreement[prompt]
        assert at_near_tie, f"v2: greedy output differs at token {agreed} of {prompt!r}"

"""GDN_BA=1 and GDN_RECURRENT=1 in the served model on a GPU: the layers take HyperQwen's kernels
and answer as with vLLM's.

The tiny synthetic checkpoint is served compiled (CUDA graphs and torch.compile, as the
launcher serves: the b/a op sits inside the compiled graph) with prefix caching and MTP k=3,
twice: vLLM's b/a GEMM and recurrent kernel, then both of HyperQwen's. The kernels round in
other orders (fp32 accumulation in other blocks), so greedy continuations must agree up to
the first near tie (test_prepare_gpu's NEAR_TIE), prompt log-probabilities within its
tolerance; the second server must log that both took their layers, the first neither.

Run on the GPU host: `pytest -m gpu tests/test_gdn_kernels_gpu.py`; summary and server logs go
to $HYPERQWEN_TEST_LOGS (gdn-kernels-summary.json).
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
from test_prepare_gpu import NEAR_TIE, PROMPTS, assert_logprobs_agree, observe
from test_step_knobs_gpu import MTP3, compiled_server

from hyperqwen.checkpoint.geometry import PRESETS
from hyperqwen.checkpoint.synthesize import synthesize
from hyperqwen.engine.features import GDN_BA, GDN_RECURRENT

pytestmark = pytest.mark.gpu

SIDES = {
    "vllm": {GDN_BA.env: "0", GDN_RECURRENT.env: "0"},
    "hyperqwen": {GDN_BA.env: "1", GDN_RECURRENT.env: "1"},
}
LOG_LINES = ("GDN b/a projection: HyperQwen's kernel", "GDN recurrent update: HyperQwen's kernel")


def test_gdn_kernels_answer_as_vllms(tmp_path, tmp_path_factory):
    require_gpu()
    logs = log_dir(tmp_path)
    base_env = with_vllm_first(patched_vllm_parent(tmp_path_factory))
    model = synthesize(tmp_path / "tiny", PRESETS["tiny"], progress=False).directory
    results, server_logs = {}, {}
    for name, variables in SIDES.items():
        port = free_port()
        log = logs / f"gdn-kernels-{name}-server.log"
        env = {**base_env, **variables, "VLLM_CACHE_ROOT": str(tmp_path / f"cache-{name}")}
        command = compiled_server(model, port, inductor_pdl=False, speculative=MTP3)
        with running_server(command, f"http://127.0.0.1:{port}", log, env) as url:
            results[name] = observe(url)
        server_logs[name] = log.read_text()
    reference, candidate = results["vllm"]["prompts"], results["hyperqwen"]["prompts"]
    summary = {
        prompt: agreeing_prefix(reference[prompt], candidate[prompt], NEAR_TIE)
        for prompt in PROMPTS
    }
    (logs / "gdn-kernels-summary.json").write_text(json.dumps(summary, indent=1))

    for line in LOG_LINES:
        assert line in server_logs["hyperqwen"] and line not in server_logs["vllm"]
    assert results["hyperqwen"]["drafted"] > 0  # verify steps ran: where both kernels serve
    for prompt in PROMPTS:
        assert_logprobs_agree(reference[prompt], candidate[prompt], prompt)
        agreed, at_near_tie = summary[prompt]
        assert at_near_tie, f"greedy output differs at token {agreed} of {prompt!r}"

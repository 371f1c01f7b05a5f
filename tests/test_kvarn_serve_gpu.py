"""KV=kvarn in a real server: the tiny synthetic Qwen3.5 (head_dim 256, 2 KV heads, as
`hyperqwen synth` makes it, prepared) served by `hyperqwen serve single` twice, with KV=auto
(vLLM's bf16 cache) and with KV=kvarn (the launcher sets HYPERQWEN_KV_KVARN=1 and passes
`--kv-cache-dtype auto --attention-backend CUSTOM`), both with SPEC=off (KV=kvarn refuses
speculation) and the same KV_MEM (the same pool; KV=kvarn's small side cache comes on top of
it: kvarn/backend.py), on
a copy of vLLM with the patch series applied (attention-kv-spec.patch among it). Each answers
greedily a prompt of a few hundred tokens, so its prefill stores and reads tile 1 and its decode
fills tiles 2 and 3 (kvarn/attention.py).

Checked: the server starts on the CUSTOM backend (the plugin registered it, the seam sized its
pages beside the GDN layers' state), and the greedy continuation is KV=auto's up to the first
step whose top-2 margin is below NEAR_TIE: a 4-bit K / 2-bit V cache changes the logits a
little, so a close call may go the other way; a wrong read (a tile in the wrong block, a token
lost) changes them a lot. The agreeing prefix and margins go to
$HYPERQWEN_TEST_LOGS/kvarn-serve-summary.json.

Run on the GPU host: `pytest -m gpu tests/test_kvarn_serve_gpu.py` (two tiny servers, one after
the other).
"""

from __future__ import annotations

import json
import shutil

import pytest
from cli_runner import ROOT
from gpu_server import (
    TRITON_GDN,
    agreeing_prefix,
    complete,
    hyperqwen_server,
    log_dir,
    patched_vllm_parent,
    require_gpu,
    top2_margins,
    with_vllm_first,
)
from local_server import free_port
from test_prepare_common import run_prepare

from hyperqwen.checkpoint.geometry import PRESETS
from hyperqwen.checkpoint.synthesize import synthesize

pytestmark = pytest.mark.gpu

ANSWER_TOKENS = 200
# the KV pool's bytes; KVarN's side cache (about 5x the pool at head_dim 256) comes on top
KV_BYTES = "1G"
NEAR_TIE = 0.5
PROMPT = " ".join(
    f"Station {i} reports wind from the {d} at {10 + i} knots and a pressure of {990 + i} hPa."
    for i, d in enumerate(["north", "east", "south", "west"] * 5)
)  # a few hundred tokens


def test_kvarn_serves_kv_autos_greedy_text_up_to_near_ties(tmp_path, tmp_path_factory):
    require_gpu()
    logs = log_dir(tmp_path)
    parent = patched_vllm_parent(tmp_path_factory)
    model = tmp_path / "served" / "tiny"  # the served name is the folder's
    shutil.copytree(synthesize(tmp_path / "tiny", PRESETS["tiny"], progress=False).directory, model)
    code, out, err = run_prepare(str(model), "--quiet")
    assert code == 0, err + out

    results = {}
    for kv in ("auto", "kvarn"):
        port = free_port()
        knobs = {
            "MODEL": str(model), "PORT": str(port), "KV": kv, "SPEC": "off", "KV_MEM": KV_BYTES,
            "MAX_LEN": "2048", "MAX_SEQS": "2", "EXTRA_ARGS": f"--seed 0 {TRITON_GDN}",
            # the kit's packages stay on the path behind the patched vLLM
            "PYTHONPATH": f"{ROOT / 'src'}:{with_vllm_first(parent)['PYTHONPATH']}",
        }  # fmt: skip
        log = logs / f"kvarn-serve-{kv}-server.log"
        with hyperqwen_server("single", knobs, log) as url:
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

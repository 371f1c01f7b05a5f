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
pages beside the GDN layers' state) and logs no ERROR line; its greedy continuation is KV=auto's
up to the first step whose top-2 margin is below NEAR_TIE (a 4-bit K / 2-bit V cache moves the
logits a little, so a close call may go the other way). That alone is weak: the random-weight
model's margins are small at most steps, so the two part within a few tokens. The decisive
check is teacher-forced: KV=auto's prompt + greedy continuation goes back to both servers with
`prompt_logprobs` (teacher_forcing.py), and the log-probabilities each gives the continuation's
tokens, at positions whose context reaches into quantized tiles, must stay within the bounds
below. A teacher-forced request is one prefill (vLLM skips the prefix cache for
`prompt_logprobs`), so this checks the tile store and the prefill's read; the decode kernel is
checked only by the greedy agreement. The per-position differences go to
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
from teacher_forcing import logprob_differences, mean_and_max_abs, teacher_forced_request
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
# the control's stand-in for the prompt's tile 1 (tokens 128-255): another request's content
OTHER_TEXT = " ".join(
    f"Order {i}: {3 * i} crates of {f} shipped to dock {i % 7}."
    for i, f in enumerate(["apples", "pears", "nails", "rope"] * 8)
)
TILE = 128
# The bounds on |log p_kvarn - log p_auto| over the continuation's tokens, teacher-forced.
# Why these. The tiny model's weights are random (std 0.02), so its next-token distribution is
# nearly flat (log p about -11, top-2 gaps of a few hundredths) and its attention layer is one of
# four adding to the residual: any change of the attended context moves each token's log p by a
# few hundredths only, so there is no absolute scale at which a 2-bit V cache is "close" and a
# wrong tile "far". What separates them is relative, so the test measures its own yardstick on
# the KV=auto server: the same sequence with tile 1's tokens replaced by another text's (a
# context swap: that tile's K and V are another request's; its tokens also pass the GDN layers,
# so this moves log p a little more than a pure KV swap would). The KVarN read must move log p
# clearly less than that, on average over the 200 positions:
#   mean |diff kvarn| <= MEAN_RATIO * mean |diff control|.
# The estimate behind MEAN_RATIO, made on the CPU with a transformers Qwen3.5 of the tiny geometry
# (random init, fp32, a few seeds; KVarN's read as attention.read_plan says with tiles through
# quantize.py's float64 encoding, the same prompt): the KVarN read moves log p by about 0.6 of the
# control on average (2-bit values: each value element carries about a third of its RMS as
# error, and the attention output averages it over a few hundred tokens, about as a tile
# of other content does); a tile read from the neighbouring block (block 1 given block 2's
# tile: one tile twice, one lost) by about 0.8, K of one block with V of another by about 1.0,
# another request's tile by about 1.15; a bf16 instead of fp32 model moves it by about 0.1.
# 0.75 leaves a correct cache about 20% headroom and fails every one of those wrong reads,
# the neighbouring block with the least margin. MAX_ABS only catches gross failures (garbage,
# NaN as -9999): a correct read peaked at about half of it per position in that estimate, as did
# the wrong reads, so the maximum cannot separate them.
MEAN_RATIO = 0.75
MAX_ABS = 0.3
# below this the control shows the model too insensitive to its context for the ratio to mean
# anything (the estimate put the control near 0.04, bf16 noise near 0.005)
CONTROL_MIN_MEAN = 0.02


def test_kvarn_serves_kv_autos_text_within_teacher_forced_bounds(tmp_path, tmp_path_factory):
    require_gpu()
    logs = log_dir(tmp_path)
    parent = patched_vllm_parent(tmp_path_factory)
    model = tmp_path / "served" / "tiny"  # the served name is the folder's
    shutil.copytree(synthesize(tmp_path / "tiny", PRESETS["tiny"], progress=False).directory, model)
    code, out, err = run_prepare(str(model), "--quiet")
    assert code == 0, err + out

    results, forced = {}, {}
    sequence: list[int] = []  # KV=auto's prompt + greedy continuation, set by the first server
    for kv in ("auto", "kvarn"):  # auto first: its answer is what both are teacher-forced on
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
            if kv == "auto":
                sequence = choice["prompt_token_ids"] + choice["token_ids"]
                other = complete(url, OTHER_TEXT, max_tokens=1, return_token_ids=True)
                swapped = list(sequence)
                swapped[TILE : 2 * TILE] = other["prompt_token_ids"][TILE : 2 * TILE]
                forced["control"] = complete(url, **teacher_forced_request(swapped))
            forced[kv] = complete(url, **teacher_forced_request(sequence))
        if kv == "kvarn":
            text = log.read_text()
            assert "Using AttentionBackendEnum.CUSTOM backend" in text
            errors = [line for line in text.splitlines() if "ERROR" in line]
            assert not errors, "KV=kvarn's server logged errors:\n" + "\n".join(errors[:20])

    start = results["auto"]["prompt_tokens"]  # the continuation: contexts past tiles 0-2
    differences = {
        name: logprob_differences(forced["auto"], forced[name], sequence, start)
        for name in ("kvarn", "control")
    }
    (kvarn_mean, kvarn_max), (control_mean, control_max) = (
        mean_and_max_abs(differences[name]) for name in ("kvarn", "control")
    )
    agreed, at_near_tie = agreeing_prefix(results["auto"], results["kvarn"], NEAR_TIE)
    summary = {
        "agreeing_prefix": agreed,
        "differs_at_near_tie": at_near_tie,
        "teacher_forced": {
            "first_position": start,
            "kvarn_mean_abs": kvarn_mean, "kvarn_max_abs": kvarn_max,
            "control_mean_abs": control_mean, "control_max_abs": control_max,
            "mean_ratio": kvarn_mean / control_mean if control_mean else None,
            "bounds": {"mean_ratio": MEAN_RATIO, "max_abs": MAX_ABS,
                       "control_min_mean": CONTROL_MIN_MEAN},
            "kvarn_differences": differences["kvarn"],
            "control_differences": differences["control"],
        },
        **results,
    }  # fmt: skip
    (logs / "kvarn-serve-summary.json").write_text(json.dumps(summary, indent=1))
    assert start > 2 * TILE, "the prompt must fill tiles 0 and 1"
    assert at_near_tie, f"greedy output differs at token {agreed} where KV=auto was sure"
    assert control_mean >= CONTROL_MIN_MEAN, (
        f"swapping a tile of context moved log p by {control_mean:.4f} on average: too little "
        "for the KVarN comparison to tell a wrong read"
    )
    assert kvarn_max <= MAX_ABS, f"KVarN moved a token's log p by {kvarn_max:.4f}"
    assert kvarn_mean <= MEAN_RATIO * control_mean, (
        f"KVarN moved log p by {kvarn_mean:.4f} on average, {kvarn_mean / control_mean:.2f} of "
        f"a context swap's {control_mean:.4f} (bound {MEAN_RATIO})"
    )

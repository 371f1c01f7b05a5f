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

The second test serves KV=kvarn with SPEC=mtp (the tiny model's MTP layer drafts 3 tokens a
step, its own attention layer on KVarN too, under vLLM's async scheduling: the host's sequence
lengths are upper bounds; kvarn/README.md, "Speculative decoding") and checks the decode path
that the first cannot: two requests decoded concurrently through verify blocks (the random
model's drafts are nearly all rejected, so almost every step rewrites rejected positions, and
tile boundaries are crossed by drafts first), each token's log-probability as the decode path
gave it against the same server's teacher-forced prefill of the same sequence (the same cache
format, stored afresh from the final tokens), bounded against a tile-swap control measured on
that server (below).

Run on the GPU host: `pytest -m gpu tests/test_kvarn_serve_gpu.py` (three tiny servers, one
after the other; `-k mtp` for the speculating one alone).
"""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
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
from teacher_forcing import (
    forced_logprobs,
    logprob_differences,
    mean_and_max_abs,
    teacher_forced_request,
)
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


# The speculating test's bound on the decode path against the same server's prefill, as a
# fraction of its tile-swap control. Both read the same quantized tiles by the same read rule;
# what differs is arithmetic: the decode kernel's 16-bit dot operands against the prefill's
# fp32, and the other layers' verify-block shapes against a prefill's (GDN verify path, GEMM
# tiling). The estimate above puts a bf16 model's noise near 0.1 of a control and the nearest
# wrong read (a neighbouring block's tile) near 0.8: 0.4 is four times the one and half the
# other. Not measured on a GPU yet. A few rejected drafts left in a stored tile (a missed
# re-store) would move log p less than a whole wrong tile: CPU-tested
# (tests/test_kvarn_speculation.py), not what this bound is sure to catch.
DECODE_MEAN_RATIO = 0.4


def tiny_model(tmp_path):
    """The tiny synthetic model, prepared, in a folder named as it is served ("tiny")."""
    model = tmp_path / "served" / "tiny"  # the served name is the folder's
    shutil.copytree(synthesize(tmp_path / "tiny", PRESETS["tiny"], progress=False).directory, model)
    code, out, err = run_prepare(str(model), "--quiet")
    assert code == 0, err + out
    return model


def server_knobs(model, kv, spec, parent):
    return {
        "MODEL": str(model), "PORT": str(free_port()), "KV": kv, "SPEC": spec,
        "KV_MEM": KV_BYTES, "MAX_LEN": "2048", "MAX_SEQS": "2",
        "EXTRA_ARGS": f"--seed 0 {TRITON_GDN}",
        # the kit's packages stay on the path behind the patched vLLM
        "PYTHONPATH": f"{ROOT / 'src'}:{with_vllm_first(parent)['PYTHONPATH']}",
    }  # fmt: skip


def assert_served_on_kvarn(log):
    text = log.read_text()
    assert "Using AttentionBackendEnum.CUSTOM backend" in text
    errors = [line for line in text.splitlines() if "ERROR" in line]
    assert not errors, "KV=kvarn's server logged errors:\n" + "\n".join(errors[:20])
    return text


def tile_swapped(sequence, other_ids):
    """The control's sequence: tile 1's tokens (128-255) replaced by another text's."""
    swapped = list(sequence)
    swapped[TILE : 2 * TILE] = other_ids[TILE : 2 * TILE]
    return swapped


def test_kvarn_serves_kv_autos_text_within_teacher_forced_bounds(tmp_path, tmp_path_factory):
    require_gpu()
    logs = log_dir(tmp_path)
    parent = patched_vllm_parent(tmp_path_factory)
    model = tiny_model(tmp_path)

    results, forced = {}, {}
    sequence: list[int] = []  # KV=auto's prompt + greedy continuation, set by the first server
    for kv in ("auto", "kvarn"):  # auto first: its answer is what both are teacher-forced on
        knobs = server_knobs(model, kv, "off", parent)
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
                swapped = tile_swapped(sequence, other["prompt_token_ids"])
                forced["control"] = complete(url, **teacher_forced_request(swapped))
            forced[kv] = complete(url, **teacher_forced_request(sequence))
        if kv == "kvarn":
            assert_served_on_kvarn(log)

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


def spec_decode_total(metrics: str, name: str) -> float:
    """A vLLM counter's value summed over its label sets, from the /metrics text (its
    `_total` samples; the `_created` ones are timestamps)."""
    sample = f"vllm:{name}_total"
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith((sample + "{", sample + " "))
    )


def test_kvarn_with_mtp_decodes_as_its_prefill_reads(tmp_path, tmp_path_factory):
    """KV=kvarn, SPEC=mtp: PROMPT and OTHER_TEXT decoded greedily at once (verify blocks of two
    requests in one batch), each generated token's log-probability from the decode path
    against the same server's teacher-forced prefill of the same prompt + continuation; the
    yardstick is that server's own control (the sequence with tile 1 swapped for the other
    text's, teacher-forced)."""
    require_gpu()
    logs = log_dir(tmp_path)
    parent = patched_vllm_parent(tmp_path_factory)
    model = tiny_model(tmp_path)
    log = logs / "kvarn-serve-mtp-server.log"
    prompts = {"prompt": PROMPT, "other": OTHER_TEXT}
    with hyperqwen_server("single", server_knobs(model, "kvarn", "mtp", parent), log) as url:

        def decode(text):
            return complete(
                url, text, max_tokens=ANSWER_TOKENS, min_tokens=ANSWER_TOKENS, logprobs=1,
                return_token_ids=True,
            )  # fmt: skip

        with ThreadPoolExecutor(len(prompts)) as pool:
            decoded = dict(zip(prompts, pool.map(decode, prompts.values()), strict=True))
        metrics = requests.get(f"{url}/metrics", timeout=10).text
        sequences, forced = {}, {}
        for name, choice in decoded.items():
            sequences[name] = choice["prompt_token_ids"] + choice["token_ids"]
            forced[name] = complete(url, **teacher_forced_request(sequences[name]))
        other_ids = decoded["other"]["prompt_token_ids"]
        swapped = tile_swapped(sequences["prompt"], other_ids)
        forced["control"] = complete(url, **teacher_forced_request(swapped))
    text = assert_served_on_kvarn(log)
    assert "Asynchronous scheduling is enabled" in text
    # the MTP layer on KVarN too: vLLM's selector (platforms/cuda.py logs this line when it
    # picks) chose no backend, as it did for the drafter before the launcher named KVarN's
    # (test_kvarn_mtp_pages.py)
    assert "out of potential backends" not in text, "a layer's attention is not KVarN's"

    drafts = spec_decode_total(metrics, "spec_decode_num_draft_tokens")
    accepted = spec_decode_total(metrics, "spec_decode_num_accepted_tokens")
    start = len(decoded["prompt"]["prompt_token_ids"])
    control = logprob_differences(forced["prompt"], forced["control"], sequences["prompt"], start)
    control_mean, _ = mean_and_max_abs(control)
    summary = {
        "draft_tokens": drafts,
        "accepted_tokens": accepted,
        "control_mean_abs": control_mean,
    }
    for name, choice in decoded.items():
        first = len(choice["prompt_token_ids"])
        prefill = forced_logprobs(forced[name], sequences[name], first)
        decoded_logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
        differences = [d - p for d, p in zip(decoded_logprobs, prefill, strict=True)]
        mean, largest = mean_and_max_abs(differences)
        summary[name] = {
            "first_position": first, "mean_abs": mean, "max_abs": largest,
            "differences": differences,
        }  # fmt: skip
    (logs / "kvarn-serve-mtp-summary.json").write_text(json.dumps(summary, indent=1))

    assert drafts > 0, "no drafts: MTP speculation did not run"
    assert start > 2 * TILE and all(len(sequence) > 3 * TILE for sequence in sequences.values()), (
        "each decode must cross a tile boundary"
    )
    assert control_mean >= CONTROL_MIN_MEAN, (
        f"swapping a tile of context moved log p by {control_mean:.4f} on average: too little "
        "for the comparison to tell a wrong read"
    )
    for name in decoded:
        mean, largest = summary[name]["mean_abs"], summary[name]["max_abs"]
        assert largest <= MAX_ABS, f"{name}: the decode path moved a token's log p by {largest}"
        assert mean <= DECODE_MEAN_RATIO * control_mean, (
            f"{name}: the decode path's log p differs from the prefill's by {mean:.4f} on "
            f"average, {mean / control_mean:.2f} of a context swap's {control_mean:.4f} "
            f"(bound {DECODE_MEAN_RATIO})"
        )

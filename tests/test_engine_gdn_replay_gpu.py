"""The GDN replay verify (GDN_REPLAY) on a GPU: the same greedy tokens as vLLM's per-draft
states, in a smaller state page.

The tiny synthetic Qwen3.5 (prepared, with its MTP layer) is served as single mode runs it —
async scheduling, full and piecewise CUDA graphs — without prefix caching at MTP's 3 greedy
drafts and with quoting's 15 (lookup at auto), and with prefix caching (vLLM's mamba `align`
mode, whose state moves and boundary copies become the replay's folds) at quoting's 15, each
with HYPERQWEN_GDN_REPLAY unset and at 1: six servers. Each answers test_engine_quoting_gpu.py's
prompts greedily, one request at a time. As there, a token cycle is planted in the checkpoint
(tests/quoting_copy.py), since a random model's answers never copy their context: the cycle
prompt makes quoting's steps accept many tokens, so later steps fold them in; MTP's random
draft head is rejected, so its verify steps replay one token.

Checked: each greedy continuation is the same tokens with and without the replay verify, up to
the first near tie, and under prefix caching each prompt's second answer (its prefix from the
cache, states the folds wrote) the same as its first; quoting's verify steps on the cycle
prompt accepted more than one token (else nothing was folded); and vLLM's own log of its
KV-cache pool shows more concurrent requests with the replay page (one state block per request
instead of 1 + W). Each configuration is its own test (two servers); what it measured goes to
$HYPERQWEN_TEST_LOGS/gdn-replay-CONFIG-summary.json.

Run on the GPU host: `pytest -m gpu tests/test_engine_gdn_replay_gpu.py` (six tiny servers,
one after another; `-k align` for the prefix-caching pair alone).
"""

from __future__ import annotations

import json
import re

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
from quoting_copy import copy_prompt
from test_engine_quoting_gpu import (
    CHAT_PROMPTS,
    CODE_PROMPT,
    MTP3,
    NEAR_TIE,
    QUOTING,
    answer,
    prepared_with_a_cycle,
    quoting_server,
)

from hyperqwen.engine.features import GDN_REPLAY, LOOKUP

pytestmark = pytest.mark.gpu

CONFIGS = {  # name: (speculative config, engine environment, prefix caching)
    "mtp3": (MTP3, {}, False),
    "quoting15": (QUOTING, {LOOKUP.env: "auto"}, False),
    "quoting15-align": (QUOTING, {LOOKUP.env: "auto"}, True),
}
CONCURRENCY = re.compile(r"Maximum concurrency for [\d,]+ tokens per request: ([\d.]+)x")


def replay_server(model, port: int, speculative: dict, prefix_cache: bool) -> list[str]:
    command = quoting_server(model, port, speculative)
    if prefix_cache:
        assert "--enable-prefix-caching" in command
        return command
    return [
        "--no-enable-prefix-caching" if arg == "--enable-prefix-caching" else arg for arg in command
    ]


@pytest.mark.parametrize("config", CONFIGS)
def test_replay_verify_keeps_greedy_tokens_and_shrinks_the_state_page(
    config, tmp_path, tmp_path_factory
):
    require_gpu()
    logs = log_dir(tmp_path)
    base_env = with_vllm_first(patched_vllm_parent(tmp_path_factory))
    for feature in (GDN_REPLAY, LOOKUP):
        base_env.pop(feature.env, None)
    model, cycle = prepared_with_a_cycle(tmp_path)
    speculative, engine_env, prefix_cache = CONFIGS[config]

    prompts = {"copy": copy_prompt(cycle), "code": CODE_PROMPT}
    prompts.update({f"chat-{i}": prompt for i, prompt in enumerate(CHAT_PROMPTS)})
    results, concurrency = {}, {}
    repeats = {}  # per prompt, the second answer's agreement with the first (prefix caching)
    for replay in ("0", "1"):
        port = free_port()
        log = logs / f"gdn-replay-{config}-replay{replay}-server.log"
        env = {**base_env, **engine_env, GDN_REPLAY.env: replay}
        command = replay_server(model, port, speculative, prefix_cache)
        with running_server(command, f"http://127.0.0.1:{port}", log, env) as url:
            results[replay] = {name: answer(url, prompt) for name, prompt in prompts.items()}
            if prefix_cache:
                again = {name: answer(url, prompt) for name, prompt in prompts.items()}
                repeats[replay] = {
                    name: agreeing_prefix(results[replay][name], again[name], NEAR_TIE)
                    for name in prompts
                }
        found = CONCURRENCY.findall(log.read_text())
        concurrency[replay] = float(found[-1]) if found else None

    summary = {
        name: {
            "agreeing_prefix": agreeing_prefix(results["0"][name], results["1"][name], NEAR_TIE),
            "tokens_per_step": [results[r][name]["tokens_per_step"] for r in "01"],
        }
        for name in prompts
    }
    record = {"answers": summary, "concurrency": concurrency, "cached_repeats": repeats}
    (logs / f"gdn-replay-{config}-summary.json").write_text(json.dumps(record, indent=1))

    for name, row in summary.items():
        agreed, at_near_tie = row["agreeing_prefix"]
        assert at_near_tie, f"{config} {name}: greedy output differs at token {agreed}"
    vllms, ours = concurrency["0"], concurrency["1"]
    assert vllms is not None and ours is not None, concurrency
    assert ours > vllms, f"{config}: concurrency {vllms}x with vLLM's page, {ours}x with ours"
    for replay, rows in repeats.items():
        for name, (agreed, at_near_tie) in rows.items():
            assert at_near_tie, (
                f"{config} replay {replay} {name}: the cached answer differs at token {agreed}"
            )
    if LOOKUP.env in engine_env:  # copies drafted: the cycle prompt's steps keep many tokens
        kept = summary["copy"]["tokens_per_step"][1]
        assert kept and kept > 1, (
            f"{config} copy: no draft kept ({kept} tokens per step), none folded"
        )

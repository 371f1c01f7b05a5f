"""Greedy answers with prefix caching, without it, and with PREFIX_CACHE_WHOLE_PROMPT on a GPU.

The tiny synthetic checkpoint (random weights; its cache blocks are 208 tokens with a float32
GDN state and a bf16 KV cache: `hyperqwen capacity` arithmetic) is served three times: without
prefix caching (the reference), with it in vLLM's mamba "align" mode, and with it and
HYPERQWEN_ALIGN_WHOLE_PROMPT=1. Each gets the same requests one after another: prompts of
several blocks that share nothing, then requests sharing a long system prompt (the third on
served from the cache). Token-id prompts make the lengths exact.

A prompt that nothing cached is prefilled in one step both without the cache and with the
feature, so those answers must be the same token ids. Where the chunks differ (vLLM's align
split, a prefix served from the cache) the arithmetic runs in another order: those answers must
agree up to a near tie of the reference, and the shared requests must report cached tokens.

Run on the GPU host: `pytest -m gpu tests/test_engine_align_whole_prompt_gpu.py`.
"""

from __future__ import annotations

import json
import random

import pytest
import requests
from gpu_server import (
    agreeing_prefix,
    log_dir,
    patched_vllm_parent,
    require_gpu,
    running_server,
    top2_margins,
    with_vllm_first,
)
from local_server import free_port
from test_prepare_gpu import NEAR_TIE, tiny_server

from hyperqwen.checkpoint.geometry import PRESETS
from hyperqwen.checkpoint.synthesize import synthesize
from hyperqwen.engine.features import ALIGN_WHOLE_PROMPT

pytestmark = pytest.mark.gpu

TOKENS = 24
rng = random.Random(0)


def ids(count: int) -> list[int]:
    return [rng.randrange(1000, 20000) for _ in range(count)]


# lengths across one, two and three 208-token blocks, none on a boundary
COLD = {f"cold{length}": ids(length) for length in (300, 500, 700)}
SYSTEM = ids(450)
SHARED = {f"shared{i}": SYSTEM + ids(60) for i in range(3)}
# the prompts no earlier request shares a cached prefix with
UNCACHED = (*COLD, "shared0")
SERVERS = {
    "no-cache": (["--no-enable-prefix-caching"], "0"),
    "align": (["--enable-prefix-caching"], "0"),
    "whole-prompt": (["--enable-prefix-caching"], "1"),
}


def answers(base: str, prompts: dict[str, list[int]]) -> dict[str, dict]:
    """Each prompt's greedy answer of TOKENS tokens, its top-2 margins and cached tokens."""
    out = {}
    for name, prompt in prompts.items():
        body = {"model": "tiny", "prompt": prompt, "temperature": 0, "max_tokens": TOKENS,
                "min_tokens": TOKENS, "logprobs": 2, "return_token_ids": True}  # fmt: skip
        response = requests.post(f"{base}/v1/completions", json=body, timeout=300)
        assert response.status_code == 200, response.text
        reply = response.json()
        choice = reply["choices"][0]
        details = reply["usage"].get("prompt_tokens_details") or {}
        out[name] = {"greedy_ids": choice["token_ids"], "margins": top2_margins(choice),
                     "cached": details.get("cached_tokens") or 0}  # fmt: skip
    return out


def answers_per_server(tmp_path, tmp_path_factory, servers: dict, prompts: dict,
                       speculative: dict | None, what: str) -> dict[str, dict]:  # fmt: skip
    """The tiny model served once per entry of `servers` ({name: (flags, env)}), one after
    another, each answering `prompts`; logs and a summary named after `what`."""
    require_gpu()
    logs = log_dir(tmp_path)
    base_env = with_vllm_first(patched_vllm_parent(tmp_path_factory))
    model = synthesize(tmp_path / "tiny", PRESETS["tiny"], progress=False).directory
    results = {}
    for name, (flags, env) in servers.items():
        port = free_port()
        command = [*tiny_server(model, port, speculative), *flags, "--enable-prompt-tokens-details"]
        log = logs / f"{what}-{name}-server.log"
        with running_server(command, f"http://127.0.0.1:{port}", log, {**base_env, **env}) as url:
            results[name] = answers(url, prompts)
    (logs / f"{what}-summary.json").write_text(json.dumps(results))
    return results


def test_the_same_answers_with_and_without_the_cache(tmp_path, tmp_path_factory):
    servers = {name: (flags, {ALIGN_WHOLE_PROMPT.env: whole_prompt})
               for name, (flags, whole_prompt) in SERVERS.items()}  # fmt: skip
    results = answers_per_server(tmp_path, tmp_path_factory, servers, {**COLD, **SHARED}, None,
                                 "align-whole-prompt")  # fmt: skip
    reference = results["no-cache"]
    for name in UNCACHED:
        assert results["whole-prompt"][name]["greedy_ids"] == reference[name]["greedy_ids"], name
    for server in ("align", "whole-prompt"):
        assert results[server]["shared2"]["cached"] > 0, f"{server}: no prefix served from cache"
        for name, answer in results[server].items():
            assert len(answer["greedy_ids"]) == TOKENS
            agreed, at_near_tie = agreeing_prefix(reference[name], answer, NEAR_TIE)
            assert at_near_tie, f"{server}: {name} differs at token {agreed}, not a near tie"

"""Quoting on a GPU: lossless, and more tokens per step where the answer copies its context.

The tiny synthetic Qwen3.5 (prepared, with its MTP layer) is served as single mode runs it —
MTP with 3 greedy drafts, async scheduling, prefix caching, full and piecewise CUDA graphs —
three ways: HYPERQWEN_LOOKUP unset; at auto (copies from the context fused into MTP's 3 slots,
engine/lookup.py); at auto with 15 draft slots (quoting: a long match verifies up to 15 copied
tokens, every other request MTP's 3, engine/quoting.py). Each server answers the same prompts
greedily, one request at a time: chat prompts, a code block followed by its first half (text the
random model does not copy), and a copy prompt sent twice, the second time from the prefix cache.

A random-weight model never copies its context (tests/quoting_copy.py says why), so before
`prepare` the test plants a cycle of ordinary tokens in the checkpoint's embedding: after each
cycle token the model's greedy choice is the next one, by a wide margin. The copy prompt (token
ids) is the cycle and then its first half: the reference continues around the cycle, copying
its context. No other prompt uses a cycle token, so they meet the model as synthesized.

Checked: every greedy continuation is the same tokens with and without lookup, up to the first
near tie (speculation changes batch shapes, not the function); on the copy prompt, where the
reference continuation repeats its context, each lookup side verifies more tokens per step than
MTP alone (1 + accepted / steps, from the server's counters around each request; with 15 slots
vLLM counts the slots quoting cut as rejected drafts, so accepted tokens per step is the figure,
not the acceptance rate); on every other prompt no lookup side verifies fewer. Everything
measured (each side's answer ids, tokens per step, and how many answer tokens the search could
have copied) goes to $HYPERQWEN_TEST_LOGS/quoting-summary.json.

SPEC=lookup on the GPU (LOOKUP_DEVICE=gpu: vLLM's `ngram_gpu` with HYPERQWEN_LOOKUP=gpu,
engine/lookup_gpu.py) is served the same way against the model without speculation, by the
second test: every greedy continuation the same up to the first near tie, and more than one
token per verify step on the copy prompts (vLLM's counters count the slots the one-step-late cut
removed as rejected drafts, so the figure is accepted tokens per scheduled step); its measures go
to $HYPERQWEN_TEST_LOGS/lookup-gpu-summary.json.

Run on the GPU host: `pytest -m gpu tests/test_engine_quoting_gpu.py` (five tiny servers, each
test's started together, about three minutes to start cold; vLLM keeps no compile cache for
`ngram_gpu`).
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import sys
from pathlib import Path

import pytest
import requests
from gpu_server import (
    TRITON_GDN,
    agreeing_prefix,
    complete,
    log_dir,
    patched_vllm_parent,
    require_gpu,
    running_server,
    top2_margins,
    with_vllm_first,
)
from local_server import free_port
from quoting_copy import (
    copy_prompt,
    copyable_tokens,
    cycle_tokens,
    plant_cycle,
    repeats_its_context,
)
from test_prepare_common import run_prepare

from hyperqwen.bench.server_process import all_running
from hyperqwen.checkpoint.geometry import PRESETS
from hyperqwen.checkpoint.synthesize import synthesize
from hyperqwen.checkpoint.tokenizer import build_fast_tokenizer
from hyperqwen.engine.features import LOOKUP, LOOKUP_ON_GPU, MTP_DRAFTS
from hyperqwen.launch import LOOKUP_MATCH, PREFILL_GRAPH_TOKENS, compilation_config

pytestmark = pytest.mark.gpu

MTP3 = {"method": "mtp", "num_speculative_tokens": MTP_DRAFTS, "draft_sample_method": "greedy"}
QUOTING = {**MTP3, "num_speculative_tokens": 15}
SIDES = {  # name: (speculative config, engine environment)
    "mtp": (MTP3, {}),
    "mtp-lookup-auto": (MTP3, {LOOKUP.env: "auto"}),
    "mtp-quoting-15": (QUOTING, {LOOKUP.env: "auto"}),
}
LOOKUP_GPU = {  # what the launcher gives vLLM for SPEC=lookup LOOKUP_DEVICE=gpu DRAFT_TOKENS=15
    "method": "ngram_gpu",
    "num_speculative_tokens": 15,
    "prompt_lookup_min": LOOKUP_MATCH[0],
    "prompt_lookup_max": LOOKUP_MATCH[1],
}
GPU_SIDES = {"off": (None, {}), "lookup-gpu": (LOOKUP_GPU, {LOOKUP.env: LOOKUP_ON_GPU})}
ANSWER_TOKENS = 160
CODE = "\n".join(
    f"def step_{i}(state, scale={i}):\n    total = state.value * scale + {i * 7}\n"
    f"    return State(value=total, count=state.count + 1)\n"
    for i in range(8)
)
CODE_PROMPT = f"{CODE}\n# The same functions again, unchanged:\n{CODE[: len(CODE) // 2]}"
CHAT_PROMPTS = (
    "The history of the printing press begins",
    "Translate to French: the cat sleeps on the warm windowsill.",
)
# A greedy step whose top two log-probabilities are closer than this may flip under the
# different batch shapes speculation runs (bf16 reductions); the comparison stops there.
NEAR_TIE = 0.1
COUNTERS = ("num_drafts", "num_accepted_tokens")


def quoting_server(model, port: int, speculative: dict | None) -> list[str]:
    spec = ["--speculative-config", json.dumps(speculative)] if speculative else []
    return [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model),
        "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
        "--language-model-only", "--max-model-len", "4096", "--max-num-seqs", "4",
        # a fixed KV pool skips vLLM's memory profile, which fails when a server beside it on
        # the GPU frees memory meanwhile (seen 2026-12-03)
        "--gpu-memory-utilization", "0.12", "--kv-cache-memory-bytes", "2G",
        "--seed", "0", "--async-scheduling",
        "--enable-prefix-caching", *spec,
        "--compilation-config", json.dumps(compilation_config(PREFILL_GRAPH_TOKENS)),
        *shlex.split(TRITON_GDN),
    ]  # fmt: skip


def counters(base: str) -> dict[str, float]:
    text = requests.get(f"{base}/metrics", timeout=30).text
    found = {}
    for name in COUNTERS:
        match = re.search(rf"^vllm:spec_decode_{name}_total\{{[^}}]*\}} ([\d.e+]+)", text, re.M)
        found[name] = float(match.group(1)) if match else 0.0
    return found


def answer(base: str, prompt: str | list[int]) -> dict:
    """A greedy continuation with each step's top-2 margin, and the tokens per verify step
    the request ran at (the server's counters before and after it; one request at a time)."""
    before = counters(base)
    choice = complete(
        base,
        prompt,
        max_tokens=ANSWER_TOKENS,
        min_tokens=ANSWER_TOKENS,
        logprobs=2,
        return_token_ids=True,
    )
    after = counters(base)
    drafts = after["num_drafts"] - before["num_drafts"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    return {
        "prompt_ids": choice.get("prompt_token_ids") or [],
        "greedy_ids": choice["token_ids"],
        "margins": top2_margins(choice),
        "verify_steps": drafts,
        "tokens_per_step": 1 + accepted / drafts if drafts else None,
    }


def prepared_with_a_cycle(tmp_path: Path) -> tuple[Path, list[int]]:
    """The tiny model with a token cycle planted (its answer to copy_prompt(cycle) copies its
    context), prepared as `hyperqwen prepare` leaves it; and the cycle."""
    model = tmp_path / "tiny-prepared"
    shutil.copytree(synthesize(tmp_path / "tiny", PRESETS["tiny"], progress=False).directory, model)
    tokenizer = build_fast_tokenizer()
    texts = (CODE_PROMPT, *CHAT_PROMPTS)
    cycle = cycle_tokens(avoid=[i for text in texts for i in tokenizer.encode(text).ids])
    plant_cycle(model, cycle)
    code, out, err = run_prepare(str(model), "--quiet")
    assert code == 0, err + out
    return model, cycle


def served(tmp_path, tmp_path_factory, sides: dict) -> tuple[Path, dict, dict]:
    """Each side's answers to the prompts (the tiny model with its planted cycle, the servers
    started together): the logs folder, the prompts and the results by side and prompt."""
    require_gpu()
    logs = log_dir(tmp_path)
    base_env = with_vllm_first(patched_vllm_parent(tmp_path_factory))
    base_env.pop(LOOKUP.env, None)
    model, cycle = prepared_with_a_cycle(tmp_path)

    prompts = {"copy": copy_prompt(cycle), "copy-cached": copy_prompt(cycle), "code": CODE_PROMPT}
    prompts.update({f"chat-{i}": prompt for i, prompt in enumerate(CHAT_PROMPTS)})
    servers = []
    for side, (speculative, engine_env) in sides.items():
        port = free_port()
        log = logs / f"quoting-{side}-server.log"
        command = quoting_server(model, port, speculative)
        servers.append(running_server(command, f"http://127.0.0.1:{port}", log,
                                      {**base_env, **engine_env}))  # fmt: skip
    # started together (each server's pool is fixed and small); queried one after another
    with all_running(servers) as urls:
        results = {
            side: {name: answer(url, prompt) for name, prompt in prompts.items()}
            for side, url in zip(sides, urls, strict=True)
        }
    return logs, prompts, results


def test_lookup_is_lossless_and_lifts_tokens_per_step_where_text_repeats(
    tmp_path, tmp_path_factory
):
    logs, prompts, results = served(tmp_path, tmp_path_factory, SIDES)
    reference = results["mtp"]
    lookup_sides = [side for side in SIDES if side != "mtp"]
    summary = {
        name: {
            "agreeing_prefix": {
                side: agreeing_prefix(reference[name], results[side][name], NEAR_TIE)
                for side in lookup_sides
            },
            "tokens_per_step": {side: results[side][name]["tokens_per_step"] for side in results},
            "verify_steps": {side: results[side][name]["verify_steps"] for side in results},
            "reference_repeats": repeats_its_context(
                reference[name]["prompt_ids"], reference[name]["greedy_ids"]
            ),
            "copyable_tokens": {
                side: copyable_tokens(
                    results[side][name]["prompt_ids"], results[side][name]["greedy_ids"]
                )
                for side in results
            },
            "reference_min_margin": min(reference[name]["margins"]),
            "prompt_ids": reference[name]["prompt_ids"],
            "greedy_ids": {side: results[side][name]["greedy_ids"] for side in results},
        }
        for name in prompts
    }
    (logs / "quoting-summary.json").write_text(json.dumps(summary, indent=1))

    for name, row in summary.items():
        for side, (agreed, at_near_tie) in row["agreeing_prefix"].items():
            assert at_near_tie, f"{name}: greedy output differs at token {agreed} with {side}"
    copying = ("copy", "copy-cached")
    for name in copying:
        assert summary[name]["reference_repeats"], (
            f"{name}: the reference continuation does not repeat its context, so this prompt "
            "cannot show lookup's gain on this checkpoint: the planted cycle did not hold "
            "(see greedy_ids and reference_min_margin in quoting-summary.json)"
        )
        steps = summary[name]["tokens_per_step"]
        for side in lookup_sides:
            assert steps[side] > steps["mtp"], f"{name}: {steps}"
    for name in summary.keys() - set(copying):
        steps = summary[name]["tokens_per_step"]
        for side in lookup_sides:
            assert steps[side] >= steps["mtp"], f"{name}: lookup made it slower: {steps}"


def test_lookup_on_the_gpu_is_lossless_and_verifies_copies(tmp_path, tmp_path_factory):
    """SPEC=lookup LOOKUP_DEVICE=gpu DRAFT_TOKENS=15 against no speculation: the same greedy
    text, and on the copy prompts more than one token per verify step."""
    logs, prompts, results = served(tmp_path, tmp_path_factory, GPU_SIDES)
    reference, ours = results["off"], results["lookup-gpu"]
    summary = {
        name: {
            "agreeing_prefix": agreeing_prefix(reference[name], ours[name], NEAR_TIE),
            "tokens_per_step": ours[name]["tokens_per_step"],
            "verify_steps": ours[name]["verify_steps"],
            "reference_repeats": repeats_its_context(
                reference[name]["prompt_ids"], reference[name]["greedy_ids"]
            ),
            "copyable_tokens": copyable_tokens(ours[name]["prompt_ids"], ours[name]["greedy_ids"]),
            "reference_min_margin": min(reference[name]["margins"]),
            "greedy_ids": {side: results[side][name]["greedy_ids"] for side in results},
        }
        for name in prompts
    }
    (logs / "lookup-gpu-summary.json").write_text(json.dumps(summary, indent=1))

    for name, row in summary.items():
        agreed, at_near_tie = row["agreeing_prefix"]
        assert at_near_tie, f"{name}: greedy output differs at token {agreed} with lookup-gpu"
    for name in ("copy", "copy-cached"):
        assert summary[name]["reference_repeats"], f"{name}: the planted cycle did not hold"
        steps = summary[name]["tokens_per_step"]
        assert steps is not None and steps > 2, f"{name}: {steps} tokens per step"

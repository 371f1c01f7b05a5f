"""Prepared checkpoints in the patched vLLM on a GPU.

1. The tiny synthetic checkpoint, prepared (int8 lm_head, embedding and MTP head), loads from
   files into vLLM's real kernels and drafts with its int8 MTP head; against the unprepared
   checkpoint served with the same flags, teacher-forced log-probabilities stay within
   LOGPROB_TOLERANCE and greedy continuations are the same tokens up to the first near tie.
2. The 27B geometry with the prepared quantization config (`synth --config-only --prepared`,
   dummy weights) against the unprepared one: weight memory saved (asserted against the
   arithmetic of the format) and C1 decode speed (recorded, not asserted: speed belongs in
   benchmarks).

Run on the GPU host: `pytest -m gpu tests/test_prepare_gpu.py`; summaries and server logs go to
$HYPERQWEN_TEST_LOGS (prepare-tiny-summary.json, prepare-27b-summary.json).
"""

from __future__ import annotations

import json
import math
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
    bench_serve,
    complete,
    log_dir,
    patched_vllm_parent,
    require_gpu,
    running_server,
    top2_margins,
    with_vllm_first,
)
from local_server import free_port
from test_prepare_common import run_prepare

from hyperqwen.bench.server_process import weight_gib
from hyperqwen.checkpoint import layout
from hyperqwen.checkpoint.geometry import PRESETS
from hyperqwen.checkpoint.synthesize import synthesize
from hyperqwen.checkpoint.w4a16 import GROUP_SIZE
from hyperqwen.synth import prepared_quantization_edit

pytestmark = pytest.mark.gpu

PROMPTS = (
    "The history of the printing press begins",
    "def fibonacci(n):\n    ",
    "Translate to French: the cat sleeps on the warm windowsill.",
)
GREEDY_TOKENS = 12
# int8 g128 round trip of lm_head and the embedding is ~0.7 % relative error per weight; on the
# tiny model's logits (std ~0.3 with its 0.02-std random weights) that moves a log-probability
# by a few thousandths. 0.05 nats is ten times that and far below what a wrong dequantization
# (scales misread, rows swapped) does to a near-uniform 248k-way distribution.
LOGPROB_TOLERANCE = 0.05
# A greedy step whose top two candidates are closer than this may flip under the tolerance
# above; the comparison of continuations stops there.
NEAR_TIE = 2 * LOGPROB_TOLERANCE


MTP2 = {"method": "mtp", "num_speculative_tokens": 2}


def assert_logprobs_agree(reference: dict, candidate: dict, what: str) -> None:
    """Two `observe` rows' teacher-forced log-probabilities: scored at the same positions, each
    within LOGPROB_TOLERANCE."""
    for want, got in zip(reference["prompt_logprobs"], candidate["prompt_logprobs"], strict=True):
        assert (want is None) == (got is None), what
        assert want is None or abs(want - got) < LOGPROB_TOLERANCE, what


def tiny_server(model: Path, port: int, speculative: dict | None = MTP2) -> list[str]:
    spec = ["--speculative-config", json.dumps(speculative)] if speculative else []
    return [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model),
        "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
        "--language-model-only", "--enforce-eager", "--max-model-len", "2048",
        "--gpu-memory-utilization", "0.2", "--seed", "0", *spec, *shlex.split(TRITON_GDN),
    ]  # fmt: skip


def observe(base: str) -> dict:
    """Per prompt: the prompt tokens' log-probabilities (teacher-forced) and a greedy
    continuation with each step's top-2 margin; plus the server's draft counter."""
    observed = {}
    for prompt in PROMPTS:
        scored = complete(base, prompt, timeout=120, max_tokens=1, prompt_logprobs=0)
        prompt_logprobs = [
            None if entry is None else next(iter(entry.values()))["logprob"]
            for entry in scored["prompt_logprobs"]
        ]
        greedy = complete(
            base,
            prompt,
            timeout=120,
            max_tokens=GREEDY_TOKENS,
            min_tokens=GREEDY_TOKENS,
            logprobs=2,
            return_token_ids=True,
        )
        observed[prompt] = {
            "prompt_logprobs": prompt_logprobs,
            "greedy_ids": greedy["token_ids"],
            "margins": top2_margins(greedy),
        }
    metrics = requests.get(f"{base}/metrics", timeout=30).text
    drafted = re.search(
        r"^vllm:spec_decode_num_draft_tokens_total\{[^}]*\} ([\d.e+]+)", metrics, re.M
    )
    return {"prompts": observed, "drafted": float(drafted.group(1)) if drafted else 0.0}


def test_prepared_tiny_checkpoint_matches_the_unprepared_one(tmp_path, tmp_path_factory):
    require_gpu()
    logs = log_dir(tmp_path)
    env = with_vllm_first(patched_vllm_parent(tmp_path_factory))
    base_model = synthesize(tmp_path / "tiny", PRESETS["tiny"], progress=False).directory
    prepared_model = tmp_path / "tiny-prepared"
    shutil.copytree(base_model, prepared_model)
    code, out, err = run_prepare(str(prepared_model), "--quiet")
    assert code == 0, err + out

    results = {}
    for name, model in (("unprepared", base_model), ("prepared", prepared_model)):
        port = free_port()
        log = logs / f"prepare-tiny-{name}-server.log"
        with running_server(tiny_server(model, port), f"http://127.0.0.1:{port}", log, env) as url:
            results[name] = observe(url)

    summary = {"drafted": {name: result["drafted"] for name, result in results.items()}}
    for prompt in PROMPTS:
        reference, candidate = (results[name]["prompts"][prompt] for name in results)
        differences = [
            abs(a - b)
            for a, b in zip(reference["prompt_logprobs"], candidate["prompt_logprobs"], strict=True)
            if a is not None
        ]
        agreed, at_near_tie = agreeing_prefix(reference, candidate, NEAR_TIE)
        summary[prompt] = {
            "max_abs_logprob_difference": max(differences),
            "mean_abs_logprob_difference": sum(differences) / len(differences),
            "greedy_tokens_equal": agreed,
            "first_difference_at_near_tie": at_near_tie,
            "unprepared_margins": reference["margins"],
        }
    (logs / "prepare-tiny-summary.json").write_text(json.dumps(summary, indent=1))

    assert results["prepared"]["drafted"] > 0, "the int8 MTP head drafted nothing"
    for prompt in PROMPTS:
        row = summary[prompt]
        assert row["max_abs_logprob_difference"] <= LOGPROB_TOLERANCE, (prompt, row)
        assert row["first_difference_at_near_tie"], (prompt, row)
    # The int8 weights are really in use: the numbers moved (bf16 -> int8 is not lossless).
    assert any(summary[prompt]["max_abs_logprob_difference"] > 0 for prompt in PROMPTS)


def _int8_saving_gib(geometry, modules: set[str]) -> float:
    """bf16 -> int8 g128 (one bf16 scale per group): bytes saved over `modules`, in GiB."""
    saved = 0.0
    for spec in layout.checkpoint_layout(geometry):
        if spec.module in modules:
            saved += math.prod(spec.shape) * (2 - 1 - 2 / GROUP_SIZE)
    return saved / 2**30


def test_prepared_27b_config_saves_weight_memory(tmp_path, tmp_path_factory):
    require_gpu()
    logs = log_dir(tmp_path)
    env = with_vllm_first(patched_vllm_parent(tmp_path_factory))
    geometry = PRESETS["27b"]
    models = {
        "unprepared": synthesize(
            tmp_path / "q27", geometry, config_only=True, progress=False
        ).directory,
        "prepared": synthesize(
            tmp_path / "q27-prepared",
            geometry,
            config_only=True,
            progress=False,
            edit_quantization=prepared_quantization_edit(geometry),
        ).directory,
    }
    measured = {}
    for name, model in models.items():
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        log = logs / f"prepare-27b-{name}-server.log"
        command = [
            sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model),
            "--served-model-name", "q27", "--host", "127.0.0.1", "--port", str(port),
            "--load-format", "dummy", "--language-model-only", "--max-model-len", "8192",
            "--gpu-memory-utilization", "0.85",
            # C1 is all that is measured: 8 slots keep CUDA-graph capture short.
            "--max-num-seqs", "8", *shlex.split(TRITON_GDN),
        ]  # fmt: skip
        with running_server(command, base, log, env):
            result = bench_serve(
                base, "q27", model, env, logs / f"prepare-27b-{name}-c1.json",
                concurrency=1, prompts=8, input_len=128, output_len=512,
            )  # fmt: skip
        measured[name] = {
            "weights_gib": weight_gib(log.read_text()),
            "c1_output_tok_s": result["output_throughput"],
            "c1_mean_tpot_ms": result["mean_tpot_ms"],
        }
    # Without a speculative config vLLM builds no MTP module: lm_head and embedding only.
    expected = _int8_saving_gib(geometry, {"lm_head", f"{layout.DECODER_PREFIX}.embed_tokens"})
    saved = measured["unprepared"]["weights_gib"] - measured["prepared"]["weights_gib"]
    summary = {
        **measured,
        "weights_saved_gib": saved,
        "weights_saved_expected_gib": expected,
        "c1_decode_ratio": measured["prepared"]["c1_output_tok_s"]
        / measured["unprepared"]["c1_output_tok_s"],
    }
    (logs / "prepare-27b-summary.json").write_text(json.dumps(summary, indent=1))
    assert saved == pytest.approx(expected, rel=0.1), summary

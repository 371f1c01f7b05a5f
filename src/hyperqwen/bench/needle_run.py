"""`bench needle`'s measuring on one healthy server (quoting_run.run_configs starts them in turn
or reaches them at their --url).

Per server: the haystack tokenized by its tokenizer, then for every depth and position one
trial sent twice, greedy, one request at a time: cold (a salt unique to the run first, so no
cached prefix serves it) and then the same ids again, which the prefix cache should serve.
vLLM's prefix-cache counters (vLLM 0.26: v1/metrics/loggers.py, vllm:prefix_cache_queries and
vllm:prefix_cache_hits, in tokens) are read around each request, which verifies the reuse where
the server exposes them. Then, per pass, each depth's haystack alone with `prompt_logprobs`:
vLLM computes those without reading the prefix cache (SamplingParams.skip_reading_prefix_cache
is set for them), so each pass is a cold prefill of the whole depth through the KV choice.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path

from hyperqwen.bench.client import BenchClient, BenchError, StreamResult, parse_counters
from hyperqwen.bench.header import server_version
from hyperqwen.bench.needle_haystack import (
    ANSWER_TOKENS,
    Needle,
    depth_name,
    place,
    salt_text,
    tokenize_haystack,
)
from hyperqwen.bench.quality_ppl import request_prompt_logprobs
from hyperqwen.bench.quoting_configs import ServerConfig
from hyperqwen.bench.quoting_run import ServerStart
from hyperqwen.bench.run import run_pass, served_model
from hyperqwen.bench.workload import COMPLETIONS_PATH

PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"
LOGPROB_DIGITS = 6  # kept per prompt token; far finer than the differences judged


@dataclass(frozen=True)
class NeedlePlan:
    """The options of one `bench needle` run."""

    configs: tuple[ServerConfig, ...]
    urls: dict[str, str]
    depths: tuple[int, ...]
    positions: tuple[float, ...]
    passes: int
    """prompt_logprobs passes per depth; 0: none (dummy weights' logprobs judge nothing)."""
    seed: int
    knobs: str
    start: ServerStart
    out: Path

    def recorded(self) -> dict:
        """What the measurements file keeps of the plan."""
        return {
            "model": self.start.model,
            "depths": list(self.depths),
            "positions": list(self.positions),
            "passes": self.passes,
            "seed": self.seed,
            "knobs": self.knobs,
            "vllm_args": self.start.vllm_args,
        }


def depth_refusal(depths: tuple[int, ...], max_model_len: int | None, where: str) -> str | None:
    """Why a depth cannot be asked of a server with this max_model_len, or None."""
    if not max_model_len:
        return None
    longest = max_model_len - ANSWER_TOKENS
    if too_deep := [depth for depth in depths if depth > longest]:
        return (
            f"--depths {depth_name(too_deep[0])} ({too_deep[0]} tokens): {where} serves "
            f"max_model_len {max_model_len}, which holds prompts of at most {longest} tokens "
            f"(and {ANSWER_TOKENS} answer tokens); give depths up to {longest} or serve with a "
            "larger --max-model-len"
        )
    return None


def _prefix_counters(client: BenchClient) -> dict[str, float]:
    return parse_counters(client.metrics_page(), (PREFIX_QUERIES, PREFIX_HITS))


def _ask(client: BenchClient, model: str, prompt: list[int], needle: Needle, label: str) -> dict:
    """One greedy answer to `prompt`, judged, with the prefix-cache tokens it hit."""
    body = {"model": model, "prompt": prompt, "max_tokens": ANSWER_TOKENS, "temperature": 0.0}
    before = _prefix_counters(client)
    (result,), _ = run_pass(client, [(COMPLETIONS_PATH, body)], 1, label)
    after = _prefix_counters(client)
    hits = after[PREFIX_HITS] - before.get(PREFIX_HITS, 0.0) if PREFIX_HITS in after else None
    return _answer(result, needle, hits)


def _answer(result: StreamResult, needle: Needle, hits: float | None) -> dict:
    return {
        "passed": needle.found_in(result.text),
        "answer": result.text,
        "ttft_s": round(result.ttft_s, 4),
        "e2e_s": round(result.e2e_s, 4),
        "prefix_cache_hit_tokens": hits,
        "cached_tokens": result.cached_tokens,
    }


def reuse_status(reused: dict) -> str:
    """verified / missed by vLLM's prefix-cache counter; assumed where the server has none."""
    hits = reused["prefix_cache_hit_tokens"]
    if hits is None:
        return "assumed (the server exposes no vllm:prefix_cache_hits counter)"
    return "verified" if hits > 0 else "missed"


def needle_trials(
    client: BenchClient, model: str, haystack: list[int], plan: NeedlePlan, nonce: str
) -> list[dict]:
    """Every (depth, position) trial, cold and then reused."""
    trials = []
    for depth in plan.depths:
        for position in plan.positions:
            needle = Needle.seeded(plan.seed, depth, position)
            salt = client.tokenize(model, salt_text(plan.seed, depth, position, nonce))
            sentence = client.tokenize(model, needle.sentence)
            question = client.tokenize(model, needle.question)
            placed = place(haystack, depth, position, salt, sentence, question)
            label = f"needle {depth_name(depth)} at {position:g}"
            cold = _ask(client, model, placed.prompt, needle, f"{label} cold")
            reused = _ask(client, model, placed.prompt, needle, f"{label} reused")
            trials.append({
                "depth": depth,
                "position": position,
                "needle_start": placed.needle_start,
                "needle_tokens": placed.needle_tokens,
                "key": needle.key,
                "value": needle.value,
                "cold": cold,
                "reused": reused,
                "reuse": reuse_status(reused),
            })  # fmt: skip
            print(f"   {label}: cold {_said(cold)}, reused {_said(reused)}", flush=True)
    return trials


def _said(answer: dict) -> str:
    cached = answer["prefix_cache_hit_tokens"]
    hits = "" if cached is None else f", {cached:.0f} tokens from the prefix cache"
    return f"{'pass' if answer['passed'] else 'FAIL'} (TTFT {answer['ttft_s']:.2f} s{hits})"


def prompt_logprobs(
    client: BenchClient, model: str, haystack: list[int], depths: tuple[int, ...], passes: int
) -> dict[str, list[list[float]]]:
    """Per depth (its token count, as a string: a JSON key), per pass, the logprob of each of
    the haystack's tokens 2..depth."""
    measured: dict[str, list[list[float]]] = {str(depth): [] for depth in depths}
    for number in range(1, passes + 1):
        for depth in depths:
            logprobs = request_prompt_logprobs(client, model, haystack[:depth])
            measured[str(depth)].append([round(value, LOGPROB_DIGITS) for value in logprobs])
            print(f"   prompt_logprobs {depth_name(depth)} pass {number}: done", flush=True)
    return measured


def measure_needle(client: BenchClient, plan: NeedlePlan) -> dict:
    """`bench needle`'s part of a configuration's record."""
    model, max_model_len = served_model(client, None)
    if refusal := depth_refusal(plan.depths, max_model_len, client.base_url):
        raise BenchError(refusal)
    haystack, facts = tokenize_haystack(client, model, max(plan.depths))
    nonce = secrets.token_hex(6)  # a server's prefix cache outlives a run
    return {
        "served_model": model,
        "max_model_len": max_model_len,
        "version": server_version(client),
        "haystack": facts,
        "trials": needle_trials(client, model, haystack, plan, nonce),
        "prompt_logprobs": (
            prompt_logprobs(client, model, haystack, plan.depths, plan.passes)
            if plan.passes
            else {}
        ),
    }

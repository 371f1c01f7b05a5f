"""`bench quoting-ceiling`'s measuring: the time of one decode step that verifies k + 1 tokens,
for k = 0 (no speculation: the chat step), 3 (MTP's default), 4, 8 and 15 drafts.

How every step verifies exactly k + 1 tokens on dummy weights, in stock vLLM 0.26.0 (read in
its source, not assumed):

* Synthetic acceptance at rate 1.0 accepts every draft: v1/sample/rejection_sampler.py's greedy
  kernel accepts a draft where a uniform draw in [0, 1) is below the position's rate, whatever
  the target's argmax, and then appends the bonus token; config/speculative.py takes rates of
  1.0 at every position (non-increasing, in [0, 1]).
* vLLM's `ngram` drafter cannot be the proposer: it drafts only where the context's last
  n-gram occurred before (v1/spec_decode/ngram_proposer.py), and after each fully accepted step
  the context ends in the bonus token, the dummy model's argmax, which no prompt can plan for:
  steps without a match verify one token and the row would mix widths.
* `FixedDrafts` (fixed_drafts.py), loaded through vLLM's `custom_class` method, proposes the
  full k for every request that sampled a token, every step. The scheduler caps drafts only at
  max_model_len (v1/core/sched/scheduler.py), which the prompts stay far from, and requests
  ignore EOS, so each makes exactly --output-tokens.
* vLLM turns async scheduling off for `custom_class` (and `ngram`) drafting (config/vllm.py),
  so every server here runs with --no-async-scheduling, k = 0 too: the rows differ in the
  verify width alone. A real server with async scheduling hides some host time per step, so
  its steps take at most these times.
* `mtp-k3` is vLLM's MTP with the model's own draft head at rate 1.0: its step less k3's is
  what MTP's three drafting passes cost on this geometry.

A request's step time is its decode time (end to end less time to first token) over its decode
steps, ceil((output tokens - 1) / (k + 1)): every step verifies k + 1, the last one too (vLLM
drops what passes max_tokens after verifying it). vLLM's spec-decode counters over the pass
check it (`refusal`): every draft accepted, k drafts per drafting step, and as many drafting
steps as decode steps; a pass that fails is kept with the reason and left out of the figures.
The counts can be exact: the scheduler counts a step's drafts before it trims what passes
max_tokens (v1/core/sched/scheduler.py), and the API server records a step's counters in the
same pass over the engine's outputs that queues its tokens (v1/engine/async_llm.py), so a
stream's last token is never seen before its step is counted.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from hyperqwen.bench.ab_argv import synthetic_spec
from hyperqwen.bench.client import BenchClient, ServerCounters, StreamResult
from hyperqwen.bench.quoting_configs import ServerConfig
from hyperqwen.bench.rows import format_row, summarize
from hyperqwen.bench.run import run_pass, served_model
from hyperqwen.bench.workload import RequestFactory, Workload, served_token_ids

FIXED_DRAFTS = "hyperqwen.bench.fixed_drafts.FixedDrafts"
VERIFY_DRAFTS = (0, 3, 4, 8, 15)
MTP = "mtp-k3"
MTP_DRAFTS = 3
SAME_FLAGS = "--no-async-scheduling"
"""vLLM flags every server here gets first: custom_class drafting turns async scheduling off."""
ACCEPT_ALL = 1.0


def config_name(drafts: int) -> str:
    return f"k{drafts}"


def ceiling_configs() -> dict[str, ServerConfig]:
    """k0 (no speculation), kK (FixedDrafts, K drafts, all accepted), mtp-k3: stock vLLM each."""
    configs = {}
    for drafts in VERIFY_DRAFTS:
        spec = {"method": "custom_class", "model": FIXED_DRAFTS, "num_speculative_tokens": drafts}
        accepted = synthetic_spec(spec, (ACCEPT_ALL,) * drafts) if drafts else None
        configs[config_name(drafts)] = ServerConfig(config_name(drafts), "vllm", None, accepted)
    mtp = {"method": "mtp", "num_speculative_tokens": MTP_DRAFTS}
    configs[MTP] = ServerConfig(MTP, "vllm", None, synthetic_spec(mtp, (ACCEPT_ALL,) * MTP_DRAFTS))
    return configs


def drafts_of(config: ServerConfig) -> int:
    return (config.speculative_config or {}).get("num_speculative_tokens", 0)


# --- the arithmetic and the check --------------------------------------------------------------


def decode_steps(output_tokens: int, drafts: int) -> int:
    """Steps after the first token, each verifying drafts + 1 tokens."""
    return math.ceil((output_tokens - 1) / (drafts + 1))


def step_times_ms(results: Sequence[StreamResult], drafts: int) -> list[float]:
    """Per request: its decode time over its decode steps, in ms (None-free: a request of one
    token has no decode step and no step time)."""
    return [
        1000 * (result.e2e_s - result.ttft_s) / decode_steps(result.output_tokens, drafts)
        for result in results
        if result.output_tokens > 1
    ]


def refusal(drafts: int, counters: ServerCounters, results: Sequence[StreamResult]) -> str | None:
    """Why the pass did not verify drafts + 1 tokens every step (None: it did), from vLLM's
    spec-decode counters over the pass."""
    steps = sum(decode_steps(result.output_tokens, drafts) for result in results)
    counted = counters.drafts or 0
    if drafts == 0:
        if counted:
            return f"the server drafted ({counted:g} drafting steps) though k0 has no speculation"
        return None
    if counters.drafts is None:
        return "/metrics has no spec-decode counters: the server does not speculate"
    if counters.draft_tokens != drafts * counted:
        return (
            f"{counters.draft_tokens:g} drafts over {counted:g} drafting steps, not {drafts} "
            "per step: the drafter proposed fewer, or the context reached max_model_len"
        )
    if counters.accepted_tokens != counters.draft_tokens:
        return (
            f"{counters.accepted_tokens:g} of {counters.draft_tokens:g} drafts accepted: "
            "synthetic acceptance at rate 1.0 is not in force"
        )
    if counted != steps:
        return f"{counted:g} drafting steps for {steps} decode steps: " + (
            "some steps verified 1 token" if counted < steps else "another client drafted"
        )
    return None


@dataclass(frozen=True)
class StepFigures:
    """One configuration's step time over its passes."""

    step_ms: float | None
    """Median over every request of the passes the counters did not refuse."""
    spread_pct: float | None
    """|highest - lowest| / mean of those passes' medians (None: fewer than two)."""
    refused: str | None
    """The first refused pass's reason, if any."""


def step_figures(record: dict) -> StepFigures:
    kept = [measured for measured in record["passes"] if not measured["refused"]]
    times = [time for measured in kept for time in measured["step_ms"]]
    medians = [statistics.median(measured["step_ms"]) for measured in kept if measured["step_ms"]]
    spread = None
    if len(medians) >= 2 and statistics.mean(medians) > 0:
        spread = round(100 * (max(medians) - min(medians)) / statistics.mean(medians), 1)
    refused = next(
        (measured["refused"] for measured in record["passes"] if measured["refused"]), None
    )
    return StepFigures(round(statistics.median(times), 3) if times else None, spread, refused)


# --- measuring ---------------------------------------------------------------------------------


@dataclass
class Measured:
    """A server being measured: its client, what it serves, and its passes so far."""

    name: str
    drafts: int
    client: BenchClient
    token_ids: tuple[int, ...]
    """What the prompts draw from (served_token_ids)."""
    record: dict


def connect(name: str, drafts: int, client: BenchClient, facts: dict) -> Measured:
    """The server of configuration `name`, asked what it serves; `facts` go into its record."""
    model, max_model_len = served_model(client, None)
    record = {
        **facts,
        "drafts": drafts,
        "served_model": model,
        "max_model_len": max_model_len,
        "passes": [],
    }
    return Measured(name, drafts, client, served_token_ids(client, model), record)


def pass_order(names: Sequence[str], number: int) -> list[str]:
    """The configurations' order in pass `number`: as given in odd passes, reversed in even
    ones, so a drift over the run (clocks, heat) does not favour one k."""
    return list(names) if number % 2 else list(reversed(names))


def _factory(server: Measured, seed: int, number: int) -> RequestFactory:
    """Pass `number`'s prompts: the same token ids on every server (salts aside)."""
    return RequestFactory(
        server.record["served_model"],
        seed=seed * 1000 + number,
        temperature=0.0,
        token_ids=server.token_ids,
    )


def warm_up(server: Measured, workload: Workload, seed: int) -> None:
    """One request, thrown away: graph capture and first-use compilation are not a step."""
    run_pass(server.client, _factory(server, seed, 0).requests(workload, 1), 1, "warm-up")


def measure_pass(
    server: Measured, workload: Workload, requests: int, seed: int, number: int, position: int
) -> None:
    """Pass `number` on one server at C1: its row, per-request step times and the check."""
    sent = _factory(server, seed, number).requests(workload, requests)
    before = server.client.counters()
    results, wall_s = run_pass(server.client, sent, 1, f"pass {number} {server.name}")
    counters = ServerCounters.between(before, server.client.counters())
    row = summarize(
        mode="single",
        data="random",
        prompt="salted",
        concurrency=1,
        results=results,
        wall_s=wall_s,
        counters=counters,
    )
    times = step_times_ms(results, server.drafts)
    refused = refusal(server.drafts, counters, results)
    median = f"{statistics.median(times):.3f} ms/step" if times else "no decode step"
    print(f"   {server.name} pass {number}: {median}; {format_row(row)}", flush=True)
    if refused:
        print(f"   {server.name} pass {number} REFUSED: {refused}", flush=True)
    server.record["passes"].append(
        {
            "pass": number,
            "position": position,
            "row": asdict(row),
            "step_ms": times,
            "refused": refused,
        }
    )


def measure_together(
    servers: Sequence[Measured], workload: Workload, passes: int, requests: int, seed: int
) -> None:
    """Servers up at once: each warmed up, then every pass visits them in pass_order."""
    by_name = {server.name: server for server in servers}
    for server in servers:
        warm_up(server, workload, seed)
    for number in range(1, passes + 1):
        for position, name in enumerate(pass_order(list(by_name), number)):
            measure_pass(by_name[name], workload, requests, seed, number, position)

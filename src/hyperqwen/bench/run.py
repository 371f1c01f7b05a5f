"""`hyperqwen bench run`: cohorts of concurrent streams against a running server, one ROW each.

Each row is a warm-up pass (one request per stream, thrown away: it pays for CUDA graph
capture, allocator growth and first-use compilation) followed by the measured pass of
C x rounds requests, C in flight at any time. vLLM's counters are read just before and just
after the measured pass, so tokens_per_step and preemptions belong to that pass alone (other
clients using the server at the same time would leak into them).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from hyperqwen.bench.client import BenchClient, BenchError, ServerCounters, StreamResult
from hyperqwen.bench.rows import Row, summarize
from hyperqwen.bench.workload import DataKind, RequestFactory, Workload
from hyperqwen.settings import Mode

RESULTS_SCHEMA = 1


@dataclass(frozen=True)
class BenchPlan:
    mode: Mode
    cohorts: tuple[int, ...]
    rounds: int
    """Measured requests per stream: a cohort of C measures C x rounds requests."""
    datasets: tuple[DataKind, ...]
    input_len: int
    output_len: int
    shared: bool
    prefill_lens: tuple[int, ...]
    prefill_requests: int
    system_prompt: int = 0
    """Tokens of one system prompt that every random-token prompt starts with; 0: none."""
    depths: tuple[int, ...] = ()
    """Prompt lengths of the depth rows: C1 decode after a cold prompt that long."""


def run_pass(
    client: BenchClient,
    requests: Sequence[tuple[str, dict[str, Any]]],
    concurrency: int,
    label: str,
) -> tuple[list[StreamResult], float]:
    """Stream `requests` with `concurrency` in flight; the results and the wall time."""
    with tqdm(total=len(requests), desc=label, unit="req", leave=False, file=sys.stderr) as bar:
        return client.stream_many(requests, concurrency, bar.update)


def measure_row(
    client: BenchClient,
    factory: RequestFactory,
    mode: Mode,
    workload: Workload,
    concurrency: int,
    count: int,
) -> Row:
    label = f"{workload.data} C={concurrency}"
    run_pass(client, factory.requests(workload, concurrency), concurrency, f"{label} warm-up")
    before = client.counters()
    results, wall_s = run_pass(client, factory.requests(workload, count), concurrency, label)
    after = client.counters()
    return summarize(
        mode=mode,
        data=workload.data,
        prompt=workload.prompt,
        concurrency=concurrency,
        results=results,
        wall_s=wall_s,
        counters=ServerCounters.between(before, after),
    )


def run_bench(
    client: BenchClient,
    factory: RequestFactory,
    plan: BenchPlan,
    on_row: Callable[[Row], None],
) -> list[Row]:
    """Every row of the plan, in order: decode rows per dataset and cohort, depth rows, then
    prefill."""
    rows = []
    for data in plan.datasets:
        workload = Workload(data, plan.shared, plan.input_len, plan.output_len, plan.system_prompt)
        for concurrency in plan.cohorts:
            count = concurrency * plan.rounds
            rows.append(measure_row(client, factory, plan.mode, workload, concurrency, count))
            on_row(rows[-1])
    for depth in plan.depths:
        workload = Workload("depth", False, depth, plan.output_len)
        rows.append(measure_row(client, factory, plan.mode, workload, 1, plan.prefill_requests))
        on_row(rows[-1])
    for prompt_len in plan.prefill_lens:
        # One output token: the request is all prefill, and its latency is its TTFT.
        workload = Workload("prefill", False, prompt_len, 1)
        rows.append(measure_row(client, factory, plan.mode, workload, 1, plan.prefill_requests))
        on_row(rows[-1])
    return rows


def served_model(client: BenchClient, wanted: str | None) -> tuple[str, int | None]:
    """The model id to request and its max_model_len, from /v1/models."""
    models = client.get_json("/v1/models").get("data") or []
    ids = [model["id"] for model in models]
    if not models:
        raise BenchError(f"{client.base_url}/v1/models lists no model")
    if wanted is None:
        chosen = models[0]
    elif wanted in ids:
        chosen = models[ids.index(wanted)]
    else:
        raise BenchError(f"--model {wanted} is not served here; the server has: {', '.join(ids)}")
    return chosen["id"], chosen.get("max_model_len")


def write_results(
    path: Path,
    started: str,
    header: dict[str, object],
    rows: Sequence[Row],
    command: Sequence[str],
) -> None:
    """The JSON of a run: what docs/results/ keeps (start date, command, header facts, rows)."""
    document = {
        "schema": RESULTS_SCHEMA,
        "date": started,
        "command": list(command),
        "header": header,
        "rows": [asdict(row) for row in rows],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")

"""ROW lines: one measured workload per line, in a format people paste and programs read back.

    ROW mode=single data=random prompt=salted C=4 n=12 in_tok=128 out_tok=512
        decode_tok_s_per_stream=61.3 decode_tok_s_total=240.8 e2e_s=8.420 ttft_p50_ms=95.1
        ttft_p99_ms=130.4 tpot_ms=16.31 tokens_per_step=2.41 cache_hit_pct=0.0 preemptions=0

(one line in reality). Every key is always present, in this order; a value that was not
measured is `-`. Floats carry fixed decimals, so `parse_row(format_row(row)) == row` and
`format_row(parse_row(line)) == line` for any line format_row wrote.

Keys: mode (single|batch, the server profile benchmarked), data (sharegpt: real chat prompts;
random: random token ids; prefill: long random prompts, one output token; copy: chat prompts
whose answer repeats a passage of the prompt), prompt (salted:
every prompt starts with a unique salt so the prefix cache cannot help; shared: one common
prefix, salt at the end, so the cache is measured; systemN: one N-token system prompt first,
then the salt, so the cache can serve exactly the system prompt), C (concurrent streams), n
(measured requests), in_tok/out_tok (mean prompt/output tokens per request, from the server's
usage),
decode_tok_s_per_stream (mean of each request's (out-1)/(e2e-ttft): the speed one user sees),
decode_tok_s_total (all output tokens / wall time of the pass), e2e_s (mean request latency),
ttft_p50_ms/ttft_p99_ms (time to first token), tpot_ms (mean time per output token after the
first), tokens_per_step (1 + accepted/drafts from vLLM's spec-decode counters; `-` without
speculative decoding), cache_hit_pct (prompt tokens served from the prefix cache),
preemptions (vLLM's preemption counter over the pass).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

from hyperqwen.bench.client import ServerCounters, StreamResult

ROW_PREFIX = "ROW"
NOT_MEASURED = "-"

# Decimals each float key is written with.
FLOAT_DECIMALS = {
    "decode_tok_s_per_stream": 1,
    "decode_tok_s_total": 1,
    "e2e_s": 3,
    "ttft_p50_ms": 1,
    "ttft_p99_ms": 1,
    "tpot_ms": 2,
    "tokens_per_step": 2,
    "cache_hit_pct": 1,
}


@dataclass(frozen=True)
class Row:
    mode: str
    data: str
    prompt: str
    C: int
    n: int
    in_tok: int
    out_tok: int
    decode_tok_s_per_stream: float | None
    decode_tok_s_total: float | None
    e2e_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_ms: float | None
    tokens_per_step: float | None
    cache_hit_pct: float | None
    preemptions: int | None

    def __post_init__(self) -> None:
        # Stored as written, so a row and its line always agree.
        for key, decimals in FLOAT_DECIMALS.items():
            value = getattr(self, key)
            if value is not None:
                object.__setattr__(self, key, round(float(value), decimals))


ROW_KEYS = tuple(field.name for field in fields(Row))
INT_KEYS = frozenset({"C", "n", "in_tok", "out_tok", "preemptions"})


def format_row(row: Row) -> str:
    parts = [ROW_PREFIX]
    for key in ROW_KEYS:
        value = getattr(row, key)
        if value is None:
            text = NOT_MEASURED
        elif key in FLOAT_DECIMALS:
            text = f"{value:.{FLOAT_DECIMALS[key]}f}"
        else:
            text = str(value)
        parts.append(f"{key}={text}")
    return " ".join(parts)


def parse_row(line: str) -> Row:
    """A Row from a line format_row wrote (surrounding whitespace allowed).

    Raises ValueError naming the problem: not a ROW line, a missing, unknown or repeated key,
    or a value of the wrong kind.
    """
    words = line.split()
    if not words or words[0] != ROW_PREFIX:
        raise ValueError(f"not a ROW line (must start with '{ROW_PREFIX} '): {line!r}")
    values: dict[str, object] = {}
    for word in words[1:]:
        key, equals, text = word.partition("=")
        if not equals or key not in ROW_KEYS:
            raise ValueError(f"unknown ROW field {word!r}; fields are: {' '.join(ROW_KEYS)}")
        if key in values:
            raise ValueError(f"ROW field {key} appears twice in {line!r}")
        values[key] = _parse_value(key, text)
    missing = [key for key in ROW_KEYS if key not in values]
    if missing:
        raise ValueError(f"ROW line lacks {', '.join(missing)}: {line!r}")
    return Row(**values)  # type: ignore[arg-type]


def _parse_value(key: str, text: str) -> object:
    if text == NOT_MEASURED:
        return None
    try:
        if key in FLOAT_DECIMALS:
            return float(text)
        if key in INT_KEYS:
            return int(text)
    except ValueError:
        raise ValueError(f"ROW field {key}={text!r} is not a number") from None
    return text


def percentile(values: Sequence[float], pct: float) -> float:
    """Linear interpolation between closest ranks (numpy's default method)."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * pct / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize(
    *,
    mode: str,
    data: str,
    prompt: str,
    concurrency: int,
    results: Sequence[StreamResult],
    wall_s: float,
    counters: ServerCounters,
) -> Row:
    """The Row of one measured pass: `results` ran `concurrency` at a time in `wall_s`."""
    ttfts_ms = [result.ttft_s * 1000 for result in results]
    tpots = [result.tpot_s for result in results if result.tpot_s]
    output_tokens = sum(result.output_tokens for result in results)
    prompt_tokens = sum(result.prompt_tokens for result in results)
    cached = [result.cached_tokens for result in results]
    decodes = output_tokens > len(results)  # some request made more than its first token
    return Row(
        mode=mode,
        data=data,
        prompt=prompt,
        C=concurrency,
        n=len(results),
        in_tok=round(prompt_tokens / len(results)),
        out_tok=round(output_tokens / len(results)),
        decode_tok_s_per_stream=_mean([1 / tpot for tpot in tpots]),
        decode_tok_s_total=output_tokens / wall_s if decodes else None,
        e2e_s=sum(result.e2e_s for result in results) / len(results),
        ttft_p50_ms=percentile(ttfts_ms, 50),
        ttft_p99_ms=percentile(ttfts_ms, 99),
        tpot_ms=_mean([tpot * 1000 for tpot in tpots]),
        tokens_per_step=counters.tokens_per_step,
        cache_hit_pct=(
            None if None in cached or not prompt_tokens else 100 * sum(cached) / prompt_tokens  # type: ignore[arg-type]
        ),
        preemptions=None if counters.preemptions is None else round(counters.preemptions),
    )

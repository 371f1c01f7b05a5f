"""`bench needle`'s judging: needle pass rates per configuration, depth and cache state, and the
prompt_logprobs agreement of each KV choice with the bf16 cache (KV=auto).

Agreement, per depth, over the haystack's tokens 2..depth (the same ids on both servers):
the mean absolute difference of their logprobs, and the perplexity delta
100 x (ppl / ppl_auto - 1), ppl = exp(-mean logprob), from each configuration's first pass.
The spread is the larger of the two configurations' pass-to-pass perplexity ranges (%), the
run-to-run noise. Issue 25's target, ppl delta <= +2 %, binds the 4-bit class (at most
FOUR_BIT_CLASS_BITS stored bits a K or V value, scales included); it is met or missed only where
the delta lies beyond the spread from it, else the run decides nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from hyperqwen.bench.needle_haystack import depth_name
from hyperqwen.bench.quoting_result import vllm_fact
from hyperqwen.bench.results import ComparisonRow, comparison_row, result_document
from hyperqwen.capacity import attention_token_bytes
from hyperqwen.kv_choices import KV_CHOICES

BASELINE = "auto"
PPL_DELTA_TARGET_PCT = 2.0
FOUR_BIT_CLASS_BITS = 4.5
REFERENCE_HEAD_DIM = 256  # the 27B's; the class is a property of the format, not the model


def bits_per_value(kv: str) -> float:
    """Stored bits a K or V value takes with this KV choice, its scales included."""
    return attention_token_bytes(kv, 1, REFERENCE_HEAD_DIM) * 8 / (2 * REFERENCE_HEAD_DIM)


def four_bit_class(kv: str) -> bool:
    return kv in KV_CHOICES and bits_per_value(kv) <= FOUR_BIT_CLASS_BITS


def perplexity(logprobs: Sequence[float]) -> float:
    return math.exp(-sum(logprobs) / len(logprobs))


def spread_pct(passes: Sequence[Sequence[float]]) -> float | None:
    """The pass-to-pass perplexity range over its mean (%); None from one pass."""
    if len(passes) < 2:
        return None
    ppls = [perplexity(logprobs) for logprobs in passes]
    return 100 * (max(ppls) - min(ppls)) / (sum(ppls) / len(ppls))


def judged_delta(delta_pct: float, target_pct: float, spread: float | None) -> str:
    """met / missed where the delta lies beyond the spread from the target; else the run
    decides nothing (also from one pass: no spread known)."""
    if spread is None or abs(delta_pct - target_pct) <= spread:
        return "decides nothing"
    return "met" if delta_pct <= target_pct else "missed"


def agreement(base: Sequence[Sequence[float]], other: Sequence[Sequence[float]], kv: str) -> dict:
    """One configuration's agreement with the baseline at one depth (per pass: logprob lists)."""
    first, reference = other[0], base[0]
    if len(first) != len(reference):
        raise ValueError(
            f"the baseline scored {len(reference)} tokens and {kv} {len(first)}: not the same "
            "prompt"
        )
    mean_abs = sum(abs(a - b) for a, b in zip(first, reference, strict=True)) / len(first)
    delta = 100 * (perplexity(first) / perplexity(reference) - 1)
    spreads = [spread_pct(base), spread_pct(other)]
    spread = None if None in spreads else max(spreads)  # type: ignore[type-var]
    judged = four_bit_class(kv)
    return {
        "scored_tokens": len(first),
        "mean_abs_logprob_diff": round(mean_abs, 6),
        "ppl_baseline": round(perplexity(reference), 4),
        "ppl": round(perplexity(first), 4),
        "ppl_delta_pct": round(delta, 3),
        "spread_pct": None if spread is None else round(spread, 3),
        "target_pct": PPL_DELTA_TARGET_PCT if judged else None,
        "status": judged_delta(delta, PPL_DELTA_TARGET_PCT, spread) if judged else "no target",
    }


def pass_rates(trials: Sequence[dict]) -> dict[str, dict[str, float]]:
    """Per depth, the share of positions passed cold and reused."""
    rates: dict[str, dict[str, float]] = {}
    for depth in dict.fromkeys(trial["depth"] for trial in trials):
        at = [trial for trial in trials if trial["depth"] == depth]
        rates[str(depth)] = {
            state: sum(trial[state]["passed"] for trial in at) / len(at)
            for state in ("cold", "reused")
        }
    return rates


def summary(configs: dict[str, dict]) -> dict:
    """The judged part of a measurements document: pass rates per configuration and, where the
    baseline was measured, every other configuration's agreement with it per depth."""
    result: dict = {"baseline": BASELINE, "configs": {}}
    base = configs.get(BASELINE)
    for name, record in configs.items():
        entry: dict = {
            "needle_pass_rate": pass_rates(record["trials"]),
            "reuse": sorted({trial["reuse"] for trial in record["trials"]}),
        }
        if base is not None and name != BASELINE:
            entry["agreement"] = {
                depth: agreement(base["prompt_logprobs"][depth], passes, name)
                for depth, passes in record["prompt_logprobs"].items()
                if depth in base["prompt_logprobs"]
            }
        result["configs"][name] = entry
    return result


def format_table(judged: dict) -> list[str]:
    """The summary as aligned lines: one per configuration and depth."""
    lines = [
        f"{'KV':<22}{'depth':>7}{'cold':>7}{'reused':>8}{'|dlogp|':>10}{'ppl d%':>9}"
        f"{'spread%':>9}  status"
    ]
    for name, entry in judged["configs"].items():
        for depth, rates in entry["needle_pass_rate"].items():
            agreed = entry.get("agreement", {}).get(depth)
            figures = "{:>10}{:>9}{:>9}  {}".format(
                *(
                    (
                        f"{agreed['mean_abs_logprob_diff']:.4f}",
                        f"{agreed['ppl_delta_pct']:+.2f}",
                        "-" if agreed["spread_pct"] is None else f"{agreed['spread_pct']:.2f}",
                        agreed["status"],
                    )
                    if agreed
                    else ("-", "-", "-", "baseline" if name == judged["baseline"] else "-")
                )
            )
            lines.append(
                f"{name:<22}{depth_name(int(depth)):>7}{rates['cold']:>7.0%}"
                f"{rates['reused']:>8.0%}{figures}"
            )
    return lines


def result_rows(configs: dict[str, dict], judged: dict) -> list[ComparisonRow]:
    """docs/results' rows: per KV choice and depth, stock = KV=auto and patched = the choice:
    perplexity over the haystack, needle pass rates cold and reused, and the cold TTFT."""
    base = configs.get(BASELINE)
    rows = []
    for name, entry in judged["configs"].items():
        for depth, rates in entry["needle_pass_rate"].items():
            prefix = f"{name}_{depth_name(int(depth))}"
            auto = judged["configs"][BASELINE]["needle_pass_rate"][depth] if base else None
            if agreed := entry.get("agreement", {}).get(depth):
                rows.append(
                    comparison_row(f"{prefix}_ppl", "ppl", agreed["ppl_baseline"], agreed["ppl"])
                )
            for state in ("cold", "reused"):
                rows.append(
                    comparison_row(
                        f"{prefix}_needle_{state}", "pass rate", auto and auto[state], rates[state]
                    )
                )
            rows.append(
                comparison_row(
                    f"{prefix}_cold_ttft",
                    "s",
                    base and _mean_cold_ttft(base, depth),
                    _mean_cold_ttft(configs[name], depth),
                )
            )
    return rows


def _mean_cold_ttft(record: dict, depth: str) -> float | None:
    ttfts = [t["cold"]["ttft_s"] for t in record["trials"] if str(t["depth"]) == depth]
    return round(sum(ttfts) / len(ttfts), 4) if ttfts else None


def build_result(document: dict) -> dict:
    """The docs/results document of a `bench needle` run's measurements (its summary made
    first): the rows, the judged summary and the plan, without the per-token logprobs."""
    configs = document["configs"]
    served = sorted({record["served_model"] for record in configs.values()})
    facts = {
        "gpu": document["gpu"],
        "vllm": vllm_fact(configs),
        "commit": document["commit"],
        "date": document["date"],
        "command": document["command"],
        "model": f"{Path(document['plan']['model'] or served[0]).name} (served as "
        f"{', '.join(served)})",
    }
    return result_document(
        facts,
        result_rows(configs, document["summary"]),
        summary=document["summary"],
        plan=document["plan"],
        notes=[
            "stock = KV=auto (the bf16 cache), patched = the KV choice named by the row; "
            "pass rate: the share of needle positions answered",
        ],
    )

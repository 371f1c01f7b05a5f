"""The HTTP side of every benchmark: streamed OpenAI requests timed event by event, and /metrics.

One `BenchClient` talks to one server (vLLM's OpenAI-compatible API, or anything speaking the
same protocol). A streamed request comes back as a `StreamResult`: time to first token, end to
end latency, the arrival time of every chunk and the token counts from the `usage` of the final
chunk (requested with `stream_options.include_usage`, so no tokenizer is needed here).
`ServerCounters` turns two /metrics scrapes into the speculative-decoding and preemption deltas
of what ran between them.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import requests
from prometheus_client.parser import text_string_to_metric_families

CONNECT_TIMEOUT_S = 10.0

# Counter names as vLLM 0.26 exposes them (prometheus_client appends _total to a Counter's
# name): vllm/v1/spec_decode/metrics.py and vllm/v1/metrics/loggers.py. Summed over engines.
SPEC_DRAFTS = "vllm:spec_decode_num_drafts_total"
SPEC_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
SPEC_ACCEPTED_TOKENS = "vllm:spec_decode_num_accepted_tokens_total"
PREEMPTIONS = "vllm:num_preemptions_total"
COUNTER_NAMES = (SPEC_DRAFTS, SPEC_DRAFT_TOKENS, SPEC_ACCEPTED_TOKENS, PREEMPTIONS)


class BenchError(Exception):
    """The benchmark cannot go on; the message says what the server did and what to change."""


class SseDecoder:
    """Splits a byte stream into the data payloads of its server-sent events.

    Network chunks split and join events anywhere, so text is buffered until a line ends. An
    event ends at a blank line; lines starting with ":" are comments (keep-alive pings servers
    send while a stream is quiet) and carry nothing; `event:`/`id:`/`retry:` fields are unused.
    """

    def __init__(self) -> None:
        self._text = codecs.getincrementaldecoder("utf-8")()
        self._pending = ""
        self._data_lines: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        """The payloads of the events this chunk completes, in order."""
        *lines, self._pending = (self._pending + self._text.decode(chunk)).split("\n")
        payloads = []
        for raw_line in lines:
            line = raw_line.removesuffix("\r")
            if not line:
                if self._data_lines:
                    payloads.append("\n".join(self._data_lines))
                    self._data_lines = []
            elif line.startswith("data:"):
                self._data_lines.append(line[5:].removeprefix(" "))
        return payloads


@dataclass(frozen=True)
class StreamResult:
    """One streamed request, timed from the moment it was sent (seconds)."""

    ttft_s: float
    e2e_s: float
    chunk_times_s: tuple[float, ...]
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int | None
    """Prompt tokens served from the prefix cache (usage.prompt_tokens_details), if reported."""
    text: str

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (e2e - ttft) / (output_tokens - 1)."""
        if self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def _choice_text(choice: dict[str, Any]) -> str:
    """Text a streamed choice adds: completion text, or chat content and reasoning."""
    if "text" in choice:
        return choice["text"] or ""
    delta = choice.get("delta") or {}
    return "".join(delta.get(key) or "" for key in ("reasoning_content", "reasoning", "content"))


@dataclass(frozen=True)
class ServerCounters:
    """vLLM counters over an interval (after minus before); None where the server has none."""

    drafts: float | None
    draft_tokens: float | None
    accepted_tokens: float | None
    preemptions: float | None

    @classmethod
    def between(cls, before: dict[str, float], after: dict[str, float]) -> ServerCounters:
        def delta(name: str) -> float | None:
            if name not in after:
                return None
            return after[name] - before.get(name, 0.0)

        return cls(*(delta(name) for name in COUNTER_NAMES))

    @property
    def tokens_per_step(self) -> float | None:
        """Tokens each verify step produced: the bonus token plus the accepted drafts.

        None without speculative decoding (no drafts counted), where every step makes one.
        """
        if not self.drafts:
            return None
        return 1.0 + (self.accepted_tokens or 0.0) / self.drafts


def parse_counters(metrics_text: str, names: Collection[str] = COUNTER_NAMES) -> dict[str, float]:
    """The samples called `names` (COUNTER_NAMES, or e.g. a histogram's NAME_sum and
    NAME_count) in a Prometheus text page, each summed over its labels; absent ones left out."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name in names:
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


class BenchClient:
    """A server at `base_url` (http://host:port, no /v1), with an optional bearer key.

    Safe to share between threads: each thread gets its own HTTP session.
    """

    def __init__(self, base_url: str, api_key: str | None, read_timeout_s: float = 600.0):
        self.base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = (CONNECT_TIMEOUT_S, read_timeout_s)
        self._local = threading.local()

    @property
    def _session(self) -> requests.Session:
        if not hasattr(self._local, "session"):
            self._local.session = requests.Session()
        return self._local.session

    def _request(self, method: str, path: str, **kwargs: Any) -> requests.Response:
        url = self.base_url + path
        try:
            response = self._session.request(
                method, url, headers=self._headers, timeout=self._timeout, **kwargs
            )
        except requests.ConnectionError as error:
            raise BenchError(self._unreachable(error)) from None
        except requests.Timeout:
            raise BenchError(self._no_answer(method, url)) from None
        if response.status_code != 200:
            raise BenchError(_http_error(method, url, response.status_code, response.text))
        return response

    def get_json(self, path: str) -> Any:
        return self._request("GET", path).json()

    def post_json(self, path: str, body: dict[str, Any]) -> Any:
        return self._request("POST", path, json=body).json()

    def post(self, path: str) -> None:
        """POST with no body, for endpoints that answer 200 and nothing (/start_profile)."""
        self._request("POST", path)

    def tokenize(self, model: str, text: str) -> list[int]:
        """Token ids of `text` as the server's tokenizer makes them, no special tokens."""
        body = {"model": model, "prompt": text, "add_special_tokens": False}
        return list(self.post_json("/tokenize", body)["tokens"])

    def metrics_page(self) -> str:
        """The server's /metrics page (Prometheus text) right now."""
        return self._request("GET", "/metrics").text

    def counters(self) -> dict[str, float]:
        """The vLLM counters on /metrics right now (see parse_counters)."""
        return parse_counters(self.metrics_page())

    def stream_many(
        self,
        requests: Sequence[tuple[str, dict[str, Any]]],
        concurrency: int,
        on_result: Callable[[], object] = lambda: None,
    ) -> tuple[list[StreamResult], float]:
        """Stream (path, body) requests, `concurrency` in flight; the results in the order of
        `requests` and the wall time of the whole pass.

        One event loop on one thread drives every stream, as `vllm bench serve` does: a thread
        per stream makes C threads wake up for every token. `on_result` runs as each request
        ends (a progress bar).
        """
        return asyncio.run(self._stream_many(requests, concurrency, on_result))

    async def _stream_many(
        self,
        requests: Sequence[tuple[str, dict[str, Any]]],
        concurrency: int,
        on_result: Callable[[], object],
    ) -> tuple[list[StreamResult], float]:
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=CONNECT_TIMEOUT_S, sock_read=self._timeout[1]
        )
        in_flight = asyncio.Semaphore(concurrency)
        async with aiohttp.ClientSession(
            headers=self._headers,
            timeout=timeout,
            connector=aiohttp.TCPConnector(limit=concurrency),
            trust_env=True,  # HTTP(S)_PROXY / NO_PROXY, as requests honours them
        ) as session:

            async def one(path: str, body: dict[str, Any]) -> StreamResult:
                async with in_flight:
                    result = await self._stream(session, path, body)
                on_result()
                return result

            start = time.perf_counter()
            tasks = [asyncio.create_task(one(path, body)) for path, body in requests]
            try:
                # gather raises the first failure at once; the rest are cancelled below
                results = list(await asyncio.gather(*tasks))
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            return results, time.perf_counter() - start

    async def _stream(
        self, session: aiohttp.ClientSession, path: str, body: dict[str, Any]
    ) -> StreamResult:
        """POST one streaming request (/v1/completions or /v1/chat/completions) and time it."""
        url = self.base_url + path
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        events = _TimedEvents(f"POST {url}")
        start = time.perf_counter()
        try:
            async with session.post(url, json=body) as response:
                if response.status != 200:
                    said = await response.text()
                    raise BenchError(_http_error("POST", url, response.status, said))
                # iter_any yields each network chunk as it arrives (a size would wait for that
                # many bytes and blur the timing).
                async for chunk in response.content.iter_any():
                    events.feed(chunk, time.perf_counter() - start)
        except TimeoutError:  # aiohttp's socket timeouts derive from it
            raise BenchError(self._no_answer("POST", url)) from None
        except aiohttp.ClientConnectorError as error:
            raise BenchError(self._unreachable(error)) from None
        except aiohttp.ClientError as error:
            raise BenchError(f"POST {url}: the connection broke mid-answer ({error})") from None
        return events.result()

    def _no_answer(self, method: str, url: str) -> str:
        return f"{method} {url}: no answer within {self._timeout[1]:g} s (--timeout)"

    def _unreachable(self, error: Exception) -> str:
        return (
            f"no server answers at {self.base_url} ({error.__class__.__name__}). Start it "
            "with `hyperqwen serve single|batch` (or single-user/serve.sh, batch/serve.sh) "
            "and wait for 'Application startup complete', or point --url at it."
        )


class _TimedEvents:
    """The events of one streamed answer, each timed when its network chunk arrived."""

    def __init__(self, request: str) -> None:
        self._request = request
        self._decoder = SseDecoder()
        self._chunk_times: list[float] = []
        self._text: list[str] = []
        self._usage: dict[str, Any] | None = None
        self._finished_at: float | None = None

    def feed(self, chunk: bytes, now: float) -> None:
        for payload in self._decoder.feed(chunk):
            if payload == "[DONE]":
                self._finished_at = now
                continue
            event = json.loads(payload)
            if "error" in event:
                raise BenchError(f"{self._request}: {event['error']}")
            if event.get("choices"):
                self._chunk_times.append(now)
                self._text.extend(_choice_text(choice) for choice in event["choices"])
            self._usage = event.get("usage") or self._usage

    def result(self) -> StreamResult:
        if self._finished_at is None:
            raise BenchError(f"{self._request}: the stream ended before [DONE]")
        if not self._chunk_times or self._usage is None:
            raise BenchError(
                f"{self._request}: the stream carried "
                f"{'no output' if not self._chunk_times else 'no usage'}; the server must "
                "honour stream_options.include_usage (vLLM does)"
            )
        details = self._usage.get("prompt_tokens_details") or {}
        return StreamResult(
            ttft_s=self._chunk_times[0],
            e2e_s=self._finished_at,
            chunk_times_s=tuple(self._chunk_times),
            prompt_tokens=int(self._usage["prompt_tokens"]),
            output_tokens=int(self._usage["completion_tokens"]),
            cached_tokens=details.get("cached_tokens"),
            text="".join(self._text),
        )


def _http_error(method: str, url: str, status: int, body: str) -> str:
    said = body.strip()[:500]
    if status == 401:
        return (
            f"{method} {url}: HTTP 401, the server wants an API key. Set VLLM_API_KEY, or put "
            "the key in api_key.txt (API_KEY_FILE), as for the server."
        )
    if status == 404 and "model" in said.lower():
        return f"{method} {url}: HTTP 404 {said}. Pass --model with an id from /v1/models."
    return f"{method} {url}: HTTP {status} {said}"

"""The local vLLM stand-in of `hyperqwen bench run`'s tests (tests/test_bench_run.py).

A FastAPI app (served on uvicorn in a background thread on a free port by the tests) streams
OpenAI completions and chat completions with fixed timing: TTFT = PREFILL_S +
PREFILL_S_PER_TOKEN x prompt tokens, then a verify step every STEP_S producing TOKENS_PER_STEP
tokens (one bonus token + accepted drafts), with an SSE keep-alive comment between steps. Its
spec-decode counters are written by vLLM's own SpecDecodingProm; it also counts preemptions (one
per request), records every prompt, the in-flight count at each request's start and when each
answer left it (rows are checked against those times, not the nominal ones), and emulates a
prefix cache (cached tokens = longest common prefix with an earlier prompt). Its tokenizer
(/tokenize) makes one token per character, id = code point, and like vLLM it refuses a prompt
with an id beyond its vocabulary of VOCAB_SIZE ids (ASCII), as vLLM refuses a Qwen-range id for
SmolLM2.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import time
import types
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import prometheus_client
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

ROOT = Path(__file__).resolve().parents[1]
API_KEY = "bench-test-key"
MODEL = "fake-qwen"
MAX_MODEL_LEN = 4096
PREFILL_S = 0.040
PREFILL_S_PER_TOKEN = 0.00002
STEP_S = 0.020
DRAFT_TOKENS = 3
TOKENS_PER_STEP = 2
TOKEN_TEXT = "t "
VOCAB_SIZE = 128
DELIVERY_S = 0.1
"""The most the bench client may see an event after this server handed it over (or send a
request before the server got it): thread switches and GC pauses of a loaded machine, with
room to spare over what a 2-core box running two CPU burners needed."""


@dataclass
class Sent:
    """When the fake server got a request and handed its first and last events to uvicorn, on
    time.perf_counter: the clock the bench client times with, since the server runs in this
    process. A client sees each event no earlier than that."""

    arrived: float
    first: float = math.nan
    done: float = math.nan

    @property
    def ttft_ms(self) -> float:
        return 1000 * (self.first - self.arrived)

    @property
    def e2e_s(self) -> float:
        return self.done - self.arrived


@dataclass
class FakeVllm:
    """State and timing of the fake server; tests read what it recorded."""

    speculative: bool = True
    fail_from: int | None = None
    """Requests from this index on get HTTP 500, as from a dead engine."""
    prompts: list[object] = field(default_factory=list)
    bodies: list[dict] = field(default_factory=list)
    in_flight_at_start: list[int] = field(default_factory=list)
    in_flight: int = 0
    sent: list[Sent] = field(default_factory=list)
    """Per request, in arrival order: when it arrived and its answer left the app."""

    def __post_init__(self) -> None:
        from vllm.v1.spec_decode.metrics import SpecDecodingProm

        self.registry = prometheus_client.CollectorRegistry()
        labels, engines = ["model_name", "engine"], {0: [MODEL, "0"], 1: [MODEL, "1"]}

        class IsolatedSpecDecodingProm(SpecDecodingProm):
            _counter_cls = functools.partial(prometheus_client.Counter, registry=self.registry)

        spec_config = types.SimpleNamespace(num_speculative_tokens=DRAFT_TOKENS)
        self.spec = IsolatedSpecDecodingProm(spec_config, labels, engines)
        preemptions = prometheus_client.Counter(
            "vllm:num_preemptions", "Preemptions.", labels, registry=self.registry
        )
        self.preemptions = {index: preemptions.labels(*values) for index, values in engines.items()}

    def reset(self, speculative: bool, fail_from: int | None = None) -> None:
        self.speculative = speculative
        self.fail_from = fail_from
        self.prompts.clear()
        self.bodies.clear()
        self.in_flight_at_start.clear()
        self.sent.clear()

    def cached_tokens(self, prompt: list) -> int:
        best = 0
        for earlier in self.prompts[:-1]:
            common = 0
            for mine, theirs in zip(prompt, earlier, strict=False):
                if mine != theirs:
                    break
                common += 1
            best = max(best, common)
        return best


def build_app(fake: FakeVllm) -> FastAPI:
    from vllm.v1.spec_decode.metrics import SpecDecodingStats

    app = FastAPI()

    def authorized(request: Request) -> bool:
        return request.headers.get("authorization") == f"Bearer {API_KEY}"

    @app.get("/health")
    async def health() -> PlainTextResponse:
        return PlainTextResponse("")

    @app.get("/version")
    async def version() -> dict:
        return {"version": "0.26.0"}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(prometheus_client.generate_latest(fake.registry).decode())

    @app.get("/v1/models")
    async def models(request: Request):
        if not authorized(request):
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
        return {"object": "list", "data": [{"id": MODEL, "max_model_len": MAX_MODEL_LEN}]}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        if not authorized(request):
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
        tokens = [ord(char) for char in (await request.json())["prompt"]]
        return {"count": len(tokens), "max_model_len": MAX_MODEL_LEN, "tokens": tokens}

    async def stream(request: Request, chat: bool):
        sent = Sent(arrived=time.perf_counter())
        if not authorized(request):
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
        body = await request.json()
        if not chat and max(body["prompt"]) >= VOCAB_SIZE:
            message = f"Token id {max(body['prompt'])} is out of vocabulary"
            return JSONResponse({"error": {"message": message, "code": 400}}, status_code=400)
        if fake.fail_from is not None and len(fake.prompts) >= fake.fail_from:
            return JSONResponse({"error": "EngineDeadError"}, status_code=500)
        assert body["stream"] and body["stream_options"] == {"include_usage": True}
        # One "token" per character of chat text (a stand-in tokenizer), token ids as given.
        prompt = list(body["messages"][-1]["content"]) if chat else list(body["prompt"])
        fake.prompts.append(body["messages"][-1]["content"] if chat else body["prompt"])
        fake.bodies.append(body)
        fake.sent.append(sent)
        cached = fake.cached_tokens(prompt)
        engine = len(fake.prompts) % 2
        fake.preemptions[engine].inc()
        fake.in_flight += 1
        fake.in_flight_at_start.append(fake.in_flight)
        max_tokens = body["max_tokens"]

        def event(text: str | None, finish: str | None = None) -> str:
            if chat:
                delta = {} if text is None else {"content": text}
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish}
            return f"data: {json.dumps({'choices': [choice], 'usage': None})}\n\n"

        async def events() -> AsyncIterator[str]:
            try:
                await asyncio.sleep(PREFILL_S + PREFILL_S_PER_TOKEN * len(prompt))
                sent.first = time.perf_counter()
                if chat:  # vLLM's first chat chunk carries the role, then the first token
                    role = {"index": 0, "delta": {"role": "assistant", "content": ""}}
                    yield f"data: {json.dumps({'choices': [role]})}\n\n"
                yield event(TOKEN_TEXT)
                made = 1
                while made < max_tokens:
                    yield ": keep-alive\n\n"
                    await asyncio.sleep(STEP_S)
                    step = min(TOKENS_PER_STEP, max_tokens - made)
                    if fake.speculative:
                        stats = SpecDecodingStats.new(DRAFT_TOKENS)
                        stats.observe_draft(DRAFT_TOKENS, step - 1)
                        fake.spec.observe(stats, engine)
                    made += step
                    yield event(TOKEN_TEXT * step)
                yield event(None, "length")
                usage = {
                    "prompt_tokens": len(prompt),
                    "completion_tokens": made,
                    "total_tokens": len(prompt) + made,
                    "prompt_tokens_details": {"cached_tokens": cached},
                }
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                sent.done = time.perf_counter()
                yield "data: [DONE]\n\n"
            finally:
                fake.in_flight -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await stream(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await stream(request, chat=True)

    return app

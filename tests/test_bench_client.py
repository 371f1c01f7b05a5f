"""`BenchClient.stream_many` against a real local HTTP server whose answers go right or wrong.

Each path of the app streams one way: /ok answers FIRST_TOKEN_S after the request and then a
token every STEP_S (counting the streams open at once, and recording when each token left the
app, on the client's clock), the others break an answer as a server can: an error event,
an end before [DONE], no usage, a dropped connection, a stall, HTTP 500.

Timing is checked against what the server recorded, never against its nominal pauses: a client
cannot see a token before the server sent it, whatever the load, but it may see it any time
later, so only the lower bounds are sound.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from local_server import free_port, serving

from hyperqwen.bench.client import BenchClient, BenchError

FIRST_TOKEN_S = 0.05
STEP_S = 0.01
TOKENS = 5
READ_TIMEOUT_S = 2.0
"""--timeout of the broken-answer passes: /stall stays silent far longer."""
GATE_S = 30.0


def event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


TOKEN = event({"choices": [{"index": 0, "text": "t ", "finish_reason": None}]})
DONE = "data: [DONE]\n\n"


def usage(prompt_tokens: int) -> str:
    return event(
        {"choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": TOKENS}}
    )


@dataclass
class OkStreams:
    """What /ok did: streams open now and the most at once; per request (keyed by its prompt
    length), when it arrived and when each token and the end left the app (perf_counter, the
    clock BenchClient times with: the server runs in this process)."""

    open_now: int = 0
    most_open: int = 0
    sent: dict[int, list[float]] = field(default_factory=dict)
    hold_until_open: int = 0
    """Streams wait (GATE_S at most) until this many were open at once, so a client that keeps
    C streams open is seen with C open however slowly its requests arrive."""


def build_app(streams: OkStreams) -> FastAPI:
    app = FastAPI()

    def streaming(events: AsyncIterator[str]) -> StreamingResponse:
        return StreamingResponse(events, media_type="text/event-stream")

    @app.post("/ok")
    async def ok(request: Request):
        arrived = time.perf_counter()
        body = await request.json()
        assert body["stream_options"] == {"include_usage": True}
        sent = streams.sent.setdefault(len(body["prompt"]), [arrived])

        async def events() -> AsyncIterator[str]:
            streams.open_now += 1
            streams.most_open = max(streams.most_open, streams.open_now)
            try:
                gate = time.monotonic() + GATE_S
                while streams.most_open < streams.hold_until_open and time.monotonic() < gate:
                    await asyncio.sleep(0.005)
                await asyncio.sleep(FIRST_TOKEN_S)
                for index in range(TOKENS):
                    if index:
                        await asyncio.sleep(STEP_S)
                    sent.append(time.perf_counter())
                    yield TOKEN
                sent.append(time.perf_counter())
                yield usage(len(body["prompt"])) + DONE
            finally:
                streams.open_now -= 1

        return streaming(events())

    @app.post("/error-event")
    async def error_event():
        async def events() -> AsyncIterator[str]:
            yield TOKEN
            yield event({"error": {"message": "EngineDeadError", "code": 500}})

        return streaming(events())

    @app.post("/no-done")
    async def no_done():
        async def events() -> AsyncIterator[str]:
            yield TOKEN + usage(1)

        return streaming(events())

    @app.post("/no-usage")
    async def no_usage():
        async def events() -> AsyncIterator[str]:
            yield TOKEN + DONE

        return streaming(events())

    @app.post("/dropped")
    async def dropped():
        async def events() -> AsyncIterator[str]:
            yield TOKEN
            raise RuntimeError("the server process died")  # uvicorn drops the connection

        return streaming(events())

    @app.post("/stall")
    async def stall():
        async def events() -> AsyncIterator[str]:
            yield TOKEN
            await asyncio.sleep(10 * READ_TIMEOUT_S)
            yield usage(1) + DONE

        return streaming(events())

    @app.post("/http-500")
    async def http_500():
        return JSONResponse({"error": "EngineDeadError"}, status_code=500)

    return app


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, OkStreams]]:
    ok = OkStreams()
    with serving(build_app(ok), log_level="critical") as port:
        yield f"http://127.0.0.1:{port}", ok


def test_a_pass_keeps_the_concurrency_and_times_every_token(served) -> None:
    url, ok = served
    ok.most_open = 0
    ok.sent.clear()
    ok.hold_until_open = 3
    finished = []
    requests = [("/ok", {"prompt": [1] * length}) for length in range(1, 10)]
    try:
        results, wall_s = BenchClient(url, None).stream_many(
            requests, 3, lambda: finished.append(1)
        )
    finally:
        ok.hold_until_open = 0
    assert len(results) == len(finished) == 9
    assert (ok.open_now, ok.most_open) == (0, 3)  # never more than 3 streams open, 3 at once
    # in the order of the requests, whatever order they finished in
    assert [result.prompt_tokens for result in results] == list(range(1, 10))
    for result in results:
        assert (result.output_tokens, result.text) == (TOKENS, "t " * TOKENS)
        arrived, *tokens, ended = ok.sent[result.prompt_tokens]
        # Each token timed from the request's send, no earlier than the server handed it over.
        assert len(result.chunk_times_s) == len(tokens) == TOKENS
        for seen, handed in zip(result.chunk_times_s, tokens, strict=True):
            assert seen >= handed - arrived
        assert result.ttft_s == result.chunk_times_s[0] < result.e2e_s
        assert result.e2e_s >= ended - arrived
    # The pass's wall time holds every request the server served.
    first_arrival = min(sent[0] for sent in ok.sent.values())
    assert wall_s >= max(sent[-1] for sent in ok.sent.values()) - first_arrival


@pytest.mark.parametrize(
    ("path", "said"),
    [
        ("/error-event", "EngineDeadError"),
        ("/no-done", "the stream ended before [DONE]"),
        ("/no-usage", "the stream carried no usage"),
        ("/dropped", "the connection broke mid-answer"),
        ("/stall", f"no answer within {READ_TIMEOUT_S:g} s (--timeout)"),
        ("/http-500", "HTTP 500"),
    ],
)
def test_a_broken_answer_stops_the_pass_with_what_went_wrong(served, path, said) -> None:
    url, _ = served
    requests = [("/ok", {"prompt": [1]}), (path, {"prompt": [1]}), ("/ok", {"prompt": [1]})]
    with pytest.raises(BenchError) as raised:
        BenchClient(url, None, read_timeout_s=READ_TIMEOUT_S).stream_many(requests, 2)
    assert said in str(raised.value) and f"POST {url}{path}" in str(raised.value)


def test_no_server_says_how_to_start_one() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(BenchError, match=f"no server answers at {url}.*hyperqwen serve"):
        BenchClient(url, None).stream_many([("/ok", {"prompt": [1]})], 1)

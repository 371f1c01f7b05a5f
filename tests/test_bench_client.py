"""`BenchClient.stream_many` against a real local HTTP server whose answers go right or wrong.

Each path of the app streams one way: /ok answers FIRST_TOKEN_S after the request and then a
token every STEP_S (counting the streams in flight), the others break an answer as a server can:
an error event, an end before [DONE], no usage, a dropped connection, a stall, HTTP 500.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from local_server import free_port, serving

from hyperqwen.bench.client import BenchClient, BenchError

FIRST_TOKEN_S = 0.05
STEP_S = 0.01
TOKENS = 5


def event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


TOKEN = event({"choices": [{"index": 0, "text": "t ", "finish_reason": None}]})
USAGE = event({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": TOKENS}})
DONE = "data: [DONE]\n\n"


def build_app(in_flight: list[int]) -> FastAPI:
    """in_flight[0]: /ok streams open now; in_flight[1]: the most open at once."""
    app = FastAPI()

    def streaming(events: AsyncIterator[str]) -> StreamingResponse:
        return StreamingResponse(events, media_type="text/event-stream")

    @app.post("/ok")
    async def ok(request: Request):
        assert (await request.json())["stream_options"] == {"include_usage": True}

        async def events() -> AsyncIterator[str]:
            in_flight[0] += 1
            in_flight[1] = max(in_flight)
            try:
                await asyncio.sleep(FIRST_TOKEN_S)
                for index in range(TOKENS):
                    if index:
                        await asyncio.sleep(STEP_S)
                    yield TOKEN
                yield USAGE + DONE
            finally:
                in_flight[0] -= 1

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
            yield TOKEN + USAGE

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
            await asyncio.sleep(5)
            yield USAGE + DONE

        return streaming(events())

    @app.post("/http-500")
    async def http_500():
        return JSONResponse({"error": "EngineDeadError"}, status_code=500)

    return app


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, list[int]]]:
    in_flight = [0, 0]
    with serving(build_app(in_flight), log_level="critical") as port:
        yield f"http://127.0.0.1:{port}", in_flight


def test_a_pass_keeps_the_concurrency_and_times_every_token(served) -> None:
    url, in_flight = served
    in_flight[1] = 0
    finished = []
    results, wall_s = BenchClient(url, None).stream_many(
        [("/ok", {"prompt": [1, 2, 3]})] * 9, 3, lambda: finished.append(1)
    )
    assert len(results) == len(finished) == 9
    assert in_flight == [0, 3]  # never more than 3 streams open, and 3 at once
    for result in results:
        assert (result.prompt_tokens, result.output_tokens, result.text) == (3, 5, "t " * 5)
        assert len(result.chunk_times_s) == TOKENS
        assert FIRST_TOKEN_S <= result.ttft_s < result.e2e_s
        assert result.tpot_s >= STEP_S
    # Three waves of three requests, each at least FIRST_TOKEN_S + 4 steps long.
    assert wall_s >= 3 * (FIRST_TOKEN_S + (TOKENS - 1) * STEP_S)


@pytest.mark.parametrize(
    ("path", "said"),
    [
        ("/error-event", "EngineDeadError"),
        ("/no-done", "the stream ended before [DONE]"),
        ("/no-usage", "the stream carried no usage"),
        ("/dropped", "the connection broke mid-answer"),
        ("/stall", "no answer within 0.5 s (--timeout)"),
        ("/http-500", "HTTP 500"),
    ],
)
def test_a_broken_answer_stops_the_pass_with_what_went_wrong(served, path, said) -> None:
    url, _ = served
    requests = [("/ok", {"prompt": [1]}), (path, {"prompt": [1]}), ("/ok", {"prompt": [1]})]
    with pytest.raises(BenchError) as raised:
        BenchClient(url, None, read_timeout_s=0.5).stream_many(requests, 2)
    assert said in str(raised.value) and f"POST {url}{path}" in str(raised.value)


def test_no_server_says_how_to_start_one() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(BenchError, match=f"no server answers at {url}.*hyperqwen serve"):
        BenchClient(url, None).stream_many([("/ok", {"prompt": [1]})], 1)

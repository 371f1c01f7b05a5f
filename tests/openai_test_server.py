"""A stand-in for `vllm serve` that `hyperqwen bench ab` can start as a real process on the CPU.

Run as `python openai_test_server.py --fake-config FILE --side SIDE serve MODEL --port P ...`:
it reads the flags vLLM would (--port, --served-model-name, --max-model-len,
--speculative-config) and ignores the others, then behaves as configured for SIDE in FILE
({"stock": {...}, "patched": {...}}: startup_s, weight_gib, prefill_ms, step_ms; for chat
answer_words and optionally changed_word). It sleeps startup_s before listening, logs its
HYPERQWEN_* variables and vLLM's "Model loading took X GiB" line, and streams /v1/completions
with one verify step every step_ms, and /v1/chat/completions the same way with an answer made of
the words of the user's text (chat_completions says how). It tokenizes one token per character
(id = code point; beyond VOCAB_SIZE ids, UNKNOWN_ID) at /tokenize and, as vLLM, refuses a prompt
with an id beyond its vocabulary. For the quality battery it answers non-streamed
prompt_logprobs requests with prompt_logprob (from the config) for every token. Each step makes
one token plus the drafts accepted: with synthetic_acceptance_rates r the mean is 1 + sum(r), as
vLLM's synthetic rejection sampler, spread evenly (no randomness); the spec-decode counters
count them. As vLLM, it keeps histograms of each streamed request's e2e latency and time per
output token. With --profiler-config (vLLM's torch profiler) it serves /start_profile and
/stop_profile, and stop writes a Chrome trace to torch_profiler_dir as vLLM's worker does: one
step range (execute_context_0(0)_generation_1(N), and its GPU copy) per step streamed while
profiling (at most max_iterations) and per step the GPU kernels of the side's "kernels_us"
({kernel name: microseconds}).

Run as a process, it logs what it did and when, on CLOCK_MONOTONIC (one clock for every process
of the machine, so a test compares these times with its own and with other processes'): lines
`STAND-IN {"event": ...}` for its start, its first healthy /health, each streamed completion
(when it arrived, when its first token and its [DONE] were sent, how many tokens it made) and
the start of its shutdown.
With $FAKE_START_GATE set it does not listen before that file exists: a test decides when
each of several servers becomes healthy.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import json
import os
import re
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import prometheus_client
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

VOCAB_SIZE = 256
UNKNOWN_ID = 0
RECORD_PREFIX = "STAND-IN "
GATE_POLL_S = 0.05


def record(event: str, **facts: float) -> None:
    """One line of the log: what happened, and when on CLOCK_MONOTONIC."""
    print(RECORD_PREFIX + json.dumps({"event": event, **facts}), flush=True)


def not_recorded(event: str, **facts: float) -> None:
    """build_app's default: an app served inside another program logs nothing."""


NEEDLE = re.compile(r"magic number for (\w+) is (\d+)\.")


def recalled(prompt: list[int], recall_within: int) -> str:
    """A needle test's answer: the value of the last needle sentence in the prompt (ids are
    code points) when it starts within recall_within tokens of the end, else a wrong number."""
    text = "".join(map(chr, prompt))
    needles = list(NEEDLE.finditer(text))
    if needles and len(text) - needles[-1].start() <= recall_within:
        return f" {needles[-1].group(2)}."
    return " 0."


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, dict]:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fake-config", required=True)
    parser.add_argument("--side", required=True)
    parser.add_argument("serve")
    parser.add_argument("model")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--served-model-name")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--speculative-config")
    parser.add_argument("--profiler-config")
    args, _vllm_flags = parser.parse_known_args(argv)
    with open(args.fake_config, encoding="utf-8") as file:
        behaviour = json.load(file)[args.side]
    return args, behaviour


def build_app(
    args: argparse.Namespace, behaviour: dict, record: Callable[..., None] = not_recorded
) -> FastAPI:
    spec = json.loads(args.speculative_config) if args.speculative_config else None
    drafts = spec["num_speculative_tokens"] if spec else 0
    accepted_per_step = sum(spec.get("synthetic_acceptance_rates") or []) if spec else 0.0
    model = args.served_model_name or args.model
    registry = prometheus_client.CollectorRegistry()
    counters = {
        name: prometheus_client.Counter(f"vllm:spec_decode_{name}", name, registry=registry)
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    }
    prefix_cache = (
        {
            name: prometheus_client.Counter(f"vllm:prefix_cache_{name}", name, registry=registry)
            for name in ("queries", "hits")
        }
        if behaviour.get("prefix_cache")
        else {}
    )
    seen_prompts: set[tuple[int, ...]] = set()

    def count_prefix_cache(prompt: list[int]) -> None:
        """As vLLM's counters, in tokens: a prompt seen before is all hits (whole blocks aside,
        which a stand-in need not model)."""
        if prefix_cache:
            prefix_cache["queries"].inc(len(prompt))
            prefix_cache["hits"].inc(len(prompt) if tuple(prompt) in seen_prompts else 0)
            seen_prompts.add(tuple(prompt))

    histograms = {
        name: prometheus_client.Histogram(f"vllm:{name}_seconds", name, registry=registry)
        for name in ("e2e_request_latency", "request_time_per_output_token")
    }

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        record("stopping", at=time.monotonic())

    app = FastAPI(lifespan=lifespan)
    profiling = {"active": False, "steps": 0}
    healthy = []

    @app.get("/health")
    async def health() -> PlainTextResponse:
        if not healthy:
            healthy.append(time.monotonic())
            record("healthy", at=healthy[0])
        return PlainTextResponse("")

    @app.get("/version")
    async def version() -> dict:
        return {"version": f"0.26.0 ({args.side} test server)"}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(prometheus_client.generate_latest(registry).decode())

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": model, "root": args.model, "max_model_len": args.max_model_len}
        return {"object": "list", "data": [card]}

    if args.profiler_config:
        profiler = json.loads(args.profiler_config)

        @app.post("/start_profile")
        async def start_profile() -> Response:
            profiling.update(active=True, steps=0)
            return Response(status_code=200)

        @app.post("/stop_profile")
        async def stop_profile() -> Response:
            profiling["active"] = False
            steps = min(profiling["steps"], profiler.get("max_iterations") or profiling["steps"])
            events = []
            for step in range(steps):
                start = step * 1000.0
                for cat in ("user_annotation", "gpu_user_annotation"):
                    events.append({"ph": "X", "cat": cat, "ts": start, "dur": 900,
                                   "name": "execute_context_0(0)_generation_1(4)"})  # fmt: skip
                for name, us in behaviour["kernels_us"].items():
                    events.append(
                        {"ph": "X", "cat": "kernel", "ts": start, "dur": us, "name": name}
                    )
            trace_dir = Path(profiler["torch_profiler_dir"])
            trace_dir.mkdir(parents=True, exist_ok=True)
            target = trace_dir / f"test-worker.{time.time_ns()}.pt.trace.json.gz"
            with gzip.open(target, "wt", encoding="utf-8") as handle:
                json.dump({"traceEvents": events}, handle)
            return Response(status_code=200)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        text = (await request.json())["prompt"]
        tokens = [ord(char) if ord(char) < VOCAB_SIZE else UNKNOWN_ID for char in text]
        return {"count": len(tokens), "max_model_len": args.max_model_len, "tokens": tokens}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await request.json()
        prompt, max_tokens = body["prompt"], body["max_tokens"]
        if isinstance(prompt, list) and max(prompt) >= VOCAB_SIZE:
            message = f"Token id {max(prompt)} is out of vocabulary"
            return JSONResponse({"error": {"message": message, "code": 400}}, status_code=400)
        if "prompt_logprobs" in body:
            logprob = {"logprob": behaviour["prompt_logprob"], "rank": 1}
            scored = [None] + [{str(token): logprob} for token in prompt[1:]]
            return JSONResponse({"choices": [{"index": 0, "text": "x", "prompt_logprobs": scored}]})
        if isinstance(prompt, list) and "recall_within" in behaviour:
            answer = [recalled(prompt, behaviour["recall_within"])]
            count_prefix_cache(prompt)
        else:
            answer = ["t"] * max_tokens

        def chunk(text: str) -> str:
            choice = {"index": 0, "text": text, "finish_reason": None}
            return f"data: {json.dumps({'choices': [choice]})}\n\n"

        return StreamingResponse(stream(answer, len(prompt), chunk), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        """The answer repeats the words of the user's text, answer_words of them (cycled):
        what each request gets is fixed by its text, as greedy decoding is. changed_word
        (where the side has one) replaces that word of every answer."""
        body = await request.json()
        content = body["messages"][-1]["content"]
        words = content.split() or ["t"]
        answer = [words[index % len(words)] for index in range(behaviour["answer_words"])]
        if (changed := behaviour.get("changed_word")) is not None:
            answer[changed] = "CHANGED"

        def chunk(text: str) -> str:
            choice = {"index": 0, "delta": {"content": text}, "finish_reason": None}
            return f"data: {json.dumps({'choices': [choice]})}\n\n"

        answer = answer[: body["max_tokens"]]
        return StreamingResponse(
            stream(answer, len(content), chunk), media_type="text/event-stream"
        )

    async def stream(
        answer: list[str], prompt_tokens: int, chunk: Callable[[str], str]
    ) -> AsyncIterator[str]:
        """One token per word of `answer`: the first after prefill_ms, then a verify step every
        step_ms making the bonus token and the drafts accepted."""
        arrived = time.monotonic()
        await asyncio.sleep(behaviour["prefill_ms"] / 1000)
        first_token = time.monotonic()
        yield chunk(answer[0] + " ")
        made, owed = 1, 0.0
        while made < len(answer):
            await asyncio.sleep(behaviour["step_ms"] / 1000)
            owed += accepted_per_step
            accepted = min(int(owed), len(answer) - made - 1)
            owed -= int(owed)
            if drafts:
                counters["num_drafts"].inc()
                counters["num_draft_tokens"].inc(drafts)
                counters["num_accepted_tokens"].inc(accepted)
            profiling["steps"] += profiling["active"]
            yield chunk("".join(word + " " for word in answer[made : made + 1 + accepted]))
            made += 1 + accepted
        finished = time.monotonic()
        histograms["e2e_request_latency"].observe(finished - arrived)
        if made > 1:
            decode_s = finished - first_token
            histograms["request_time_per_output_token"].observe(decode_s / (made - 1))
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": made}
        yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
        done = time.monotonic()
        record("completion", arrived=arrived, first_sent=first_token, done_sent=done, tokens=made)
        yield "data: [DONE]\n\n"

    return app


def main() -> None:
    record("started", at=time.monotonic())
    args, behaviour = parse_args()
    # vLLM loads weights and compiles before it listens; /health is unreachable meanwhile.
    time.sleep(behaviour["startup_s"])
    if gate := os.environ.get("FAKE_START_GATE"):
        while not os.path.exists(gate):
            time.sleep(GATE_POLL_S)
    for name in sorted(os.environ):  # the engine knobs the launcher hands the patched vLLM
        if name.startswith("HYPERQWEN_"):
            print(f"env {name}={os.environ[name]}", flush=True)
    print(
        f"Model loading took {behaviour['weight_gib']:.2f} GiB memory and 0.5 seconds", flush=True
    )
    app = build_app(args, behaviour, record)
    # the stdlib loop: uvloop's timers count whole milliseconds (tests/local_server.py)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", loop="asyncio")


if __name__ == "__main__":
    main()

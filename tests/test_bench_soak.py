"""`hyperqwen bench soak` against an OpenAI-style server on this machine: every request is
counted in exactly one outcome, malformed ones must be refused, and a server that cuts streams
or hangs is caught as `lost` (the GPU soak of the real server is tests/test_soak_gpu.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import Iterator

import process_group
import pytest
from cli_runner import run_in_process
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from local_server import serving

from hyperqwen.bench.soak import MIX, OUTCOMES, Target, soak

MAX_MODEL_LEN = 512


def fake_server(cut_every: int = 0, hang_every: int = 0) -> FastAPI:
    """Answers like vLLM's OpenAI server for one model "tiny"; with cut_every=n every n-th
    stream ends without [DONE], with hang_every=n every n-th plain answer never comes."""
    app = FastAPI()
    served = {"streams": 0, "plain": 0}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"data": [{"id": "tiny", "max_model_len": MAX_MODEL_LEN}]}

    async def answer(request: Request, chat: bool):
        try:
            body = json.loads(await request.body())
        except json.JSONDecodeError:
            return JSONResponse({"error": {"message": "bad JSON"}}, status_code=400)
        if body.get("model") != "tiny":
            return JSONResponse({"error": {"message": "no such model"}}, status_code=404)
        if (chat and "messages" not in body) or body.get("max_tokens", 1) < 1:
            return JSONResponse({"error": {"message": "invalid"}}, status_code=400)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) + body["max_tokens"] > MAX_MODEL_LEN:
            return JSONResponse({"error": {"message": "too long"}}, status_code=400)
        if not body.get("stream"):
            served["plain"] += 1
            if hang_every and served["plain"] % hang_every == 0:
                await asyncio.sleep(5)  # past the client's 2 s --timeout
            return {"choices": [{"index": 0, "text": "x", "finish_reason": "length"}]}
        served["streams"] += 1
        cut = cut_every and served["streams"] % cut_every == 0

        chunk = json.dumps({"choices": [{"index": 0, "delta": {"content": "x"}}]})

        async def events():
            for _ in range(8):
                yield f"data: {chunk}\n\n"
                await asyncio.sleep(0.005)
            if not cut:
                yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await answer(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await answer(request, chat=False)

    return app


@pytest.fixture
def serve() -> Iterator:
    """Start an app with tests/local_server.py's serving(); its URL. Stopped after the test."""
    with contextlib.ExitStack() as servers:
        yield lambda app: f"http://127.0.0.1:{servers.enter_context(serving(app))}"


def test_a_sound_server_loses_nothing_and_every_kind_is_sent(serve) -> None:
    url = serve(fake_server())
    target = Target(url, None, "tiny", MAX_MODEL_LEN, timeout_s=10)
    report = soak(target, 6, concurrency=6, slots=2, warmup_s=1, api_pid=os.getpid(),
                  burst_every_s=2, sample_every_s=1)  # fmt: skip
    outcomes = report["outcomes"]
    assert set(outcomes) == {*MIX, "burst"}
    assert report["totals"]["lost"] == 0 and report["unexpected"] == {}
    assert set(outcomes["malformed"]) == {"client_error"}  # every flaw refused
    assert outcomes["disconnect"].get("dropped", 0) > 0
    # Whole bursts of 4 x slots, every request answered. How many fit in the 6 s depends on
    # how fast this machine serves them; the first comes at 2 s, long before the end.
    assert set(outcomes["burst"]) == {"ok"}
    assert outcomes["burst"]["ok"] >= 4 * 2 and outcomes["burst"]["ok"] % (4 * 2) == 0
    for kind in ("chat_stream", "chat", "completion", "tools", "long_prompt"):
        assert set(outcomes[kind]) == {"ok"}, kind  # the long prompt fits the context exactly
    counted = sum(sum(by_outcome.values()) for by_outcome in outcomes.values())
    assert counted == sum(report["totals"].values())
    assert set(report["totals"]) == set(OUTCOMES)
    assert report["memory_after_warmup"]["api_rss_mib"] > 0  # this process, sampled
    # The warm-up (1 s) lasts until the first burst, sent after 2 s, has been answered.
    assert report["memory_after_warmup"]["at_s"] >= 2
    samples = report["memory_samples"]
    assert samples[0] == report["memory_after_warmup"]
    assert samples[-1] == report["memory_at_end"]
    assert [sample["at_s"] for sample in samples] == sorted(sample["at_s"] for sample in samples)
    assert all(sample["api_rss_mib"] > 0 for sample in samples)
    # A latency per answered request: as many as the ok outcomes, per kind and over all.
    latency = report["latency_s"]
    answered = {kind: ok["ok"] for kind, ok in outcomes.items() if "ok" in ok}
    assert {kind: row["n"] for kind, row in latency.items()} == {
        **answered,
        "all": report["totals"]["ok"],
    }
    assert all(0 < row["p50"] <= row["p99"] for row in latency.values())


def test_cut_streams_and_hangs_are_lost_and_fail_the_command(serve, tmp_path, capsys) -> None:
    url = serve(fake_server(cut_every=5, hang_every=7))
    out = tmp_path / "soak.json"
    argv = ["bench", "soak", "--url", url, "--minutes", "0.1", "--warmup-s", "1"]
    argv += [
        "--slots",
        "2",
        "--timeout",
        "2",
        "--env-file",
        str(tmp_path / "none.env"),
        "--out",
        str(out),
    ]
    (tmp_path / "none.env").write_text("")
    assert run_in_process(*argv) == 1
    report = json.loads(out.read_text())
    assert report["totals"]["lost"] > 0
    lost_kinds = {kind for kind, by in report["outcomes"].items() if by.get("lost")}
    assert "chat_stream" in lost_kinds  # a stream cut without [DONE]
    assert lost_kinds & {"chat", "completion", "tools", "long_prompt"}  # an answer that hung
    assert "lost" in capsys.readouterr().out
    assert report["command"].startswith("hyperqwen bench soak --url")


def test_a_server_that_is_not_there_is_a_usage_error(tmp_path, capsys) -> None:
    (tmp_path / "none.env").write_text("")
    argv = [
        "bench",
        "soak",
        "--url",
        "http://127.0.0.1:9",
        "--env-file",
        str(tmp_path / "none.env"),
    ]
    assert run_in_process(*argv) == 2
    assert "http://127.0.0.1:9" in capsys.readouterr().err


def test_gpu_memory_is_the_servers_processes_where_nvidia_smi_lists_them(tmp_path, monkeypatch):
    """Summed over the server's process tree (an engine core runs under the API process), so
    two servers can soak side by side; the whole GPU where nvidia-smi lists none of them."""
    from hyperqwen.bench.soak import gpu_memory

    with (
        process_group.started(["sleep", "60"]) as engine,  # under this process, as an engine
        process_group.started(["sleep", "60"]) as stranger,  # not listed: another PID namespace
    ):
        smi = tmp_path / "nvidia-smi"
        smi.write_text(
            '#!/bin/sh\ncase "$1" in\n'
            f"  --query-compute-apps=*) echo '{os.getpid()}, 500'; echo '{engine.pid}, 1500';"
            " echo '4000000, 7000';;\n"
            "  --query-gpu=*) echo '9000';;\nesac\n"
        )
        smi.chmod(0o755)
        monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
        assert gpu_memory(os.getpid()) == {"gpu_used_mib": 2000.0, "gpu_scope": "server processes"}
        assert gpu_memory(stranger.pid) == {"gpu_used_mib": 9000.0, "gpu_scope": "whole GPU"}
        monkeypatch.setenv("PATH", str(tmp_path / "no-nvidia-smi"))
        assert gpu_memory(os.getpid()) == {"gpu_used_mib": None, "gpu_scope": None}


def test_the_activation_budget_is_read_from_vllms_startup_line() -> None:
    from hyperqwen.bench.soak import profiled_activation_mib

    line = (
        "(EngineCore pid=2824) INFO 12-03 08:14:04 [gpu_worker.py:857] Free memory on device "
        "(138.12/139.8 GiB) on startup. Desired GPU memory utilization is (0.4, 55.92 GiB). "
        "Actual usage is 16.83 GiB for weight, {} GiB for peak activation, 20.25 GiB for "
        "non-torch memory, and 2.48 GiB for CUDAGraph memory."
    )
    assert profiled_activation_mib(line.format("2.58")) == 2.58 * 1024
    restarted = line.format("9.0") + "\n" + line.format("1.5")  # the last start counts
    assert profiled_activation_mib(restarted) == 1.5 * 1024
    assert profiled_activation_mib("INFO Starting vLLM API server") is None

"""`hyperqwen bench run` end to end against a real local HTTP server speaking vLLM's protocol
(tests/fake_vllm_bench.py: fixed prefill and step times, vLLM's own spec-decode counters, an
emulated prefix cache); each row is checked against what that server recorded.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_runner import run_in_process
from fake_vllm_bench import (
    API_KEY,
    DELIVERY_S,
    MODEL,
    ROOT,
    TOKENS_PER_STEP,
    FakeVllm,
    Sent,
    build_app,
)
from local_server import free_port, serving

from hyperqwen.bench.copy_tasks import CODE_TASK, PASSAGE_CHARS, copy_prompts
from hyperqwen.bench.rows import Row, parse_row, percentile
from hyperqwen.bench.workload import SALT_TEXT_BYTES, SALT_TOKENS


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[FakeVllm, int]]:
    fake = FakeVllm()
    with serving(build_app(fake)) as port:
        yield fake, port


@pytest.fixture
def env_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, server) -> Path:
    """A .env giving PORT and API_KEY_FILE, as a user's would; no stray knobs from outside."""
    for name in ("VLLM_API_KEY", "PORT", "API_KEY_FILE", "ENV_FILE"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "api_key.txt").write_text(API_KEY + "\n")
    path = tmp_path / ".env"
    path.write_text(f"PORT={server[1]}\nAPI_KEY_FILE={tmp_path / 'api_key.txt'}\n")
    return path


def bench_run(mode: str, env_file: Path, *args: str) -> int:
    """`hyperqwen bench run MODE --env-file ENV_FILE ARGS...`, in this process; its exit code."""
    return run_in_process("bench", "run", mode, "--env-file", str(env_file), *args)


def short_single_run(env_file: Path, out: Path, cohorts: str) -> int:
    """A quick `bench run single` of random tokens: one round of 2-token answers, no prefill."""
    short = ("--rounds", "1", "--output-len", "2", "--prefill", "none")
    return bench_run(
        "single", env_file, "--random-tokens", "--cohorts", cohorts, *short, "--out", str(out)
    )


def rows_of(output: str) -> list:
    return [parse_row(line) for line in output.splitlines() if line.startswith("ROW ")]


def split_by_row(values: list, rows: list) -> list[tuple[list, list]]:
    """Per row: (warm-up part, measured part) of what the server recorded in request order."""
    parts, start = [], 0
    for row in rows:
        warm = values[start : start + row.C]
        measured = values[start + row.C : start + row.C + row.n]
        parts.append((warm, measured))
        start += row.C + row.n
    assert start == len(values), "the server saw other requests than warm-up + measured"
    return parts


def salt_of(prompt: str | list[int]) -> str:
    """A salted prompt's salt: a chat prompt's first word (SALT_TEXT_BYTES bytes in hex), a
    random-token prompt's first SALT_TOKENS ids."""
    if isinstance(prompt, str):
        salt = prompt.split(" ", 1)[0]
        assert len(salt) == 2 * SALT_TEXT_BYTES, prompt[:40]
        return salt
    return str(prompt[:SALT_TOKENS])


def check_row_timing(row: Row, sent: list[Sent]) -> None:
    """The row's timings against what the server recorded for the row's measured requests.

    A client sees an event no earlier than the server handed it over and sends a request no
    later than the server got it: each timing is at least the server's (less the row's
    rounding), however loaded the machine. Upper bounds allow the client DELIVERY_S to send
    each request and to see each event. The time per token is held tighter, to DELIVERY_S over
    the whole decode, since both its ends are seen late: that tells it from a time per step
    (TOKENS_PER_STEP times longer) and from a decode whose first or last event was taken wrong.
    """
    late = DELIVERY_S
    for pct, measured_ms in ((50, row.ttft_p50_ms), (99, row.ttft_p99_ms)):
        server_ms = percentile([request.ttft_ms for request in sent], pct)
        assert server_ms - 0.05 <= measured_ms <= server_ms + 2000 * late, (pct, server_ms)
    e2e_s = statistics.mean(request.e2e_s for request in sent)
    assert e2e_s - 0.0005 <= row.e2e_s <= e2e_s + 2 * late, e2e_s
    # The pass holds every request the server served: wall time is at least their span.
    span_s = max(request.done for request in sent) - min(request.arrived for request in sent)
    tokens = row.n * row.out_tok  # every request makes exactly --output-len tokens here
    if row.decode_tok_s_total is not None:
        total = row.decode_tok_s_total
        assert tokens / (span_s + 2 * late) - 0.05 <= total <= tokens / span_s + 0.05, span_s
    if row.tpot_ms is not None:
        # Both ends of the decode are seen late, by 0 to DELIVERY_S each.
        decode_s = statistics.mean(request.done - request.first for request in sent)
        allowed_ms = 1000 * late / (row.out_tok - 1)
        assert abs(row.tpot_ms - 1000 * decode_s / (row.out_tok - 1)) <= allowed_ms + 0.005


def test_single_run_measures_what_the_server_does(server, env_file, tmp_path, capsys) -> None:
    fake, _ = server
    fake.reset(speculative=True)
    out = tmp_path / "results" / "single.json"
    code = bench_run(
        "single",
        env_file,
        "--cohorts",
        "1,3",
        "--rounds",
        "2",
        "--input-len",
        "64",
        "--output-len",
        "21",
        "--prefill",
        "1024,2048,8192",
        "--prefill-requests",
        "2",
        "--out",
        str(out),
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "skipping prefill 8192: max_model_len is 4096" in captured.err
    assert "# vllm: 0.26.0" in captured.out
    assert "# gpu: not measured" in captured.out  # no nvidia-smi on the CPU test machine
    rows = rows_of(captured.out)
    assert [(row.data, row.C) for row in rows] == [
        ("sharegpt", 1),
        ("sharegpt", 3),
        ("random", 1),
        ("random", 3),
        ("prefill", 1),
        ("prefill", 1),
    ]
    parts = split_by_row(fake.prompts, rows)
    in_flight = split_by_row(fake.in_flight_at_start, rows)
    sent_by_row = [measured for _, measured in split_by_row(fake.sent, rows)]

    decode_rows = rows[:4]
    for row, (warm, measured), (_, flights), sent in zip(
        decode_rows, parts[:4], in_flight[:4], sent_by_row[:4], strict=True
    ):
        assert row.mode == "single" and row.prompt == "salted"
        assert len(warm) == row.C and row.n == row.C * 2  # the warm-up pass is not in n
        assert max(flights) == row.C  # the cohort really had C requests in flight
        assert row.out_tok == 21
        check_row_timing(row, sent)
        assert row.tokens_per_step == pytest.approx(TOKENS_PER_STEP)
        assert row.preemptions == row.n  # one per measured request: warm-up ones excluded
        assert row.cache_hit_pct < 5  # salted: the cache finds (almost) nothing
        # Salting: every prompt the server saw starts with its own salt (the whole salt: its
        # first 4 hex digits alone once collided in CI)
        salts = [salt_of(prompt) for prompt in [*warm, *measured]]
        assert len(set(salts)) == len(salts), salts

    assert all(row.in_tok == 64 for row in rows if row.data == "random")

    prefill_rows = rows[4:]
    assert [row.in_tok for row in prefill_rows] == [1024, 2048]
    for row, sent in zip(prefill_rows, sent_by_row[4:], strict=True):
        check_row_timing(row, sent)
        assert row.out_tok == 1 and row.tpot_ms is None and row.tokens_per_step is None

    document = json.loads(out.read_text())
    assert [Row(**values) for values in document["rows"]] == rows
    assert document["header"]["vllm"] == "0.26.0"
    assert document["command"][:4] == ["hyperqwen", "bench", "run", "single"]
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_depth_rows_decode_after_a_cold_prompt_of_each_length(
    server, env_file, tmp_path, capsys
) -> None:
    """--depths: C1 decode rows after salted prompts of each length, --output-len tokens each,
    --prefill-requests of them; a depth that with the output exceeds max_model_len is skipped."""
    fake, _ = server
    fake.reset(speculative=True)
    out = tmp_path / "depth.json"
    code = bench_run(
        "single", env_file, "--cohorts", "1", "--rounds", "1", "--output-len", "21",
        "--prefill", "none", "--depths", "512,2048,4080", "--prefill-requests", "2",
        "--random-tokens", "--out", str(out),
    )  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "skipping depth 4080: with --output-len 21 it exceeds max_model_len 4096" in (
        captured.err
    )
    rows = rows_of(captured.out)
    assert [(row.data, row.C, row.in_tok) for row in rows] == [
        ("random", 1, 128),
        ("depth", 1, 512),
        ("depth", 1, 2048),
    ]
    parts = split_by_row(fake.prompts, rows)
    for row, (warm, measured), (_, sent) in zip(
        rows[1:], parts[1:], split_by_row(fake.sent, rows)[1:], strict=True
    ):
        assert row.prompt == "salted" and row.n == 2 and len(warm) == 1
        assert row.out_tok == 21 and row.tpot_ms is not None
        check_row_timing(row, sent)
        salts = [salt_of(prompt) for prompt in [*warm, *measured]]
        assert len(set(salts)) == len(salts), salts
    command = json.loads(out.read_text())["command"]
    assert command[command.index("--depths") + 1] == "512,2048,4080"


def test_a_system_prompt_is_shared_and_the_rest_is_each_requests_own(
    server, env_file, tmp_path, capsys
) -> None:
    fake, _ = server
    fake.reset(speculative=False)
    common = ("--cohorts", "2", "--rounds", "2", "--input-len", "200", "--output-len", "3",
              "--prefill", "none", "--out", str(tmp_path / "system.json"))  # fmt: skip
    code = bench_run("batch", env_file, *common, "--system-prompt", "150", "--random-tokens")
    captured = capsys.readouterr()
    assert code == 0, captured.err
    (row,) = rows_of(captured.out)
    assert (row.prompt, row.in_tok, row.n) == ("system150", 200, 4)
    prompts = fake.prompts
    assert len(prompts) == 6 and all(len(prompt) == 200 for prompt in prompts)
    assert all(prompt[:150] == prompts[0][:150] for prompt in prompts)
    assert len({tuple(prompt[150:154]) for prompt in prompts}) == 6  # the salt comes next
    assert 75 <= row.cache_hit_pct < 80  # the system prompt, 150 of 200 tokens, from the cache
    command = json.loads((tmp_path / "system.json").read_text())["command"]
    assert command[command.index("--system-prompt") + 1] == "150"

    for refused in (("--system-prompt", "196", "--random-tokens"),  # no room for its salt
                    ("--system-prompt", "100"),  # ShareGPT rows too
                    ("--system-prompt", "100", "--random-tokens", "--shared")):  # fmt: skip
        assert bench_run("batch", env_file, *common, *refused) != 0
        assert "--system-prompt" in capsys.readouterr().err
    assert bench_run("batch", env_file, *common, "--prefill", "4") == 2  # its salt fills it
    assert "must be more than 4 tokens (the salt)" in capsys.readouterr().err


def test_shared_batch_run_hits_the_cache_and_reports_no_speculation(
    server, env_file, tmp_path, capsys
) -> None:
    fake, _ = server
    fake.reset(speculative=False)
    code = bench_run(
        "batch",
        env_file,
        "--cohorts",
        "2",
        "--rounds",
        "2",
        "--input-len",
        "200",
        "--output-len",
        "3",
        "--shared",
        "--random-tokens",
        "--prefill",
        "none",
        "--out",
        str(tmp_path / "batch.json"),
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    (row,) = rows_of(captured.out)
    assert (row.mode, row.data, row.prompt, row.C, row.n) == ("batch", "random", "shared", 2, 4)
    assert row.tokens_per_step is None  # no drafts counted: "-"
    assert "tokens_per_step=-" in captured.out
    assert row.cache_hit_pct > 90  # all but the salt comes from the (emulated) cache
    prompts = fake.prompts
    assert len(prompts) == 6
    assert all(prompt[:-4] == prompts[0][:-4] for prompt in prompts)
    assert len({tuple(prompt[-4:]) for prompt in prompts}) == 6
    # No prefill rows: the plot still draws (an empty panel once broke the axis limits).
    assert (tmp_path / "batch.png").read_bytes()[:4] == b"\x89PNG"


def test_without_matplotlib_the_json_is_still_written(
    server, env_file, tmp_path, capsys, monkeypatch
) -> None:
    server[0].reset(speculative=True)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import now fails
    out = tmp_path / "plain.json"
    code = short_single_run(env_file, out, cohorts="1")
    assert code == 0
    assert "matplotlib is not installed" in capsys.readouterr().err
    assert len(json.loads(out.read_text())["rows"]) == 1
    assert not out.with_suffix(".png").exists()


def test_wrong_key_and_no_server_fail_with_the_fix(server, env_file, tmp_path, capsys) -> None:
    (tmp_path / "api_key.txt").write_text("not-the-key\n")
    assert bench_run("single", env_file, "--random-tokens") == 1
    assert "HTTP 401, the server wants an API key" in capsys.readouterr().err

    url = f"http://127.0.0.1:{free_port()}"
    assert bench_run("single", env_file, "--url", url, "--random-tokens") == 1
    error = capsys.readouterr().err
    assert f"no server answers at {url}" in error and "hyperqwen serve" in error


def test_a_failure_mid_run_keeps_the_rows_measured_before(
    server, env_file, tmp_path, capsys
) -> None:
    server[0].reset(speculative=True, fail_from=2)  # row 1: warm-up + 1 request; row 2 fails
    out = tmp_path / "partial.json"
    code = short_single_run(env_file, out, cohorts="1,2")
    captured = capsys.readouterr()
    assert code == 1
    assert "HTTP 500" in captured.err and f"1 measured row(s) kept in {out}" in captured.err
    assert [row["C"] for row in json.loads(out.read_text())["rows"]] == [1]
    assert len(rows_of(captured.out)) == 1


def test_extra_body_reaches_every_request_and_cannot_override_the_lengths(
    server, env_file, tmp_path, capsys
) -> None:
    server[0].reset(speculative=False)
    out = tmp_path / "extra.json"
    argv = ("--cohorts", "2", "--rounds", "1", "--output-len", "3", "--prefill", "64")
    extra = '{"top_k": 20, "chat_template_kwargs": {"enable_thinking": false}}'
    run = ("batch", env_file, "--random-tokens", *argv)
    assert bench_run(*run, "--extra-body", extra, "--out", str(out)) == 0
    assert len(server[0].bodies) == 2 + 2 + 1 + 3  # warm-up + measured, decode and prefill
    for body in server[0].bodies:
        assert body["top_k"] == 20 and body["chat_template_kwargs"] == {"enable_thinking": False}
        assert body["max_tokens"] in (3, 1) and body["ignore_eos"] is True
    command = json.loads(out.read_text())["command"]
    assert command[command.index("--extra-body") + 1] == json.dumps(json.loads(extra))
    capsys.readouterr()

    for wrong, said in [
        ('{"max_tokens": 5, "top_k": 2}', "max_tokens: set by the harness itself"),
        ("[1]", "give a JSON object"),
        ("{top_k: 2}", "is not JSON"),
    ]:
        with pytest.raises(SystemExit) as exited:
            bench_run(*run, "--extra-body", wrong)
        assert exited.value.code == 2 and said in capsys.readouterr().err


def test_unknown_model_lists_the_served_ones(server, env_file, capsys) -> None:
    code = bench_run("single", env_file, "--random-tokens", "--model", "other")
    assert code == 1
    assert f"the server has: {MODEL}" in capsys.readouterr().err


def test_help_teaches_with_examples(capsys) -> None:
    with pytest.raises(SystemExit):
        run_in_process("bench", "run", "--help")
    text = capsys.readouterr().out
    assert "hyperqwen bench run single" in text and "--shared" in text and "Exit codes" in text


def test_run_benchmarks_sh_hands_everything_to_hyperqwen_bench_run(tmp_path: Path) -> None:
    venv_bin = tmp_path / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    recorder = venv_bin / "hyperqwen"
    recorder.write_text('#!/bin/sh\nprintf "%s|" "$PWD" "$@"\n')
    recorder.chmod(0o755)
    done = subprocess.run(
        ["bash", str(ROOT / "bench" / "run_benchmarks.sh"), "single", "--out", "a b.json"],
        env={"PATH": os.environ["PATH"], "HYPERQWEN_VENV": str(tmp_path / "venv")},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{ROOT}|bench|run|single|--out|a b.json|"


def test_copy_rows_send_chat_prompts_that_hold_a_passage_to_repeat(
    server, env_file, tmp_path, capsys
) -> None:
    fake, _ = server
    fake.reset(speculative=True)
    out = tmp_path / "copy.json"
    argv = ("--random-tokens", "--copy", "--cohorts", "2", "--rounds", "2", "--prefill", "none")
    assert bench_run("single", env_file, *argv, "--output-len", "9", "--out", str(out)) == 0
    rows = rows_of(capsys.readouterr().out)
    assert [(row.data, row.C) for row in rows] == [("random", 2), ("copy", 2)]
    assert rows[1].tokens_per_step == pytest.approx(TOKENS_PER_STEP)
    copy_bodies = [body for body in fake.bodies if "messages" in body]
    assert len(copy_bodies) == 2 + 4  # warm-up and measured requests of the copy row
    prompts = set(copy_prompts())
    for body in copy_bodies:
        salt, text = body["messages"][0]["content"].split(" ", 1)
        assert len(salt) == 12 and text in prompts  # salted first, then a copy task whole
        assert "ignore_eos" not in body and body["max_tokens"] == 9  # the answer ends itself
    assert "--copy" in json.loads(out.read_text())["command"]


def test_copy_prompts_are_half_prose_half_code_passages_of_bounded_size() -> None:
    prompts = copy_prompts()
    code = [prompt for prompt in prompts if prompt.startswith(CODE_TASK.split("{")[0])]
    assert len(prompts) >= 40 and len(code) == len(prompts) // 2
    assert prompts == copy_prompts()  # the same every call: seeded runs send the same prompts
    for prompt in prompts:
        passage = prompt.split("\n\n", 1)[1].removeprefix("```python\n").removesuffix("\n```")
        assert PASSAGE_CHARS[0] <= len(passage) <= PASSAGE_CHARS[1]

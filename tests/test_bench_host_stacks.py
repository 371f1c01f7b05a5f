"""bench/host_stacks.py: py-spy's raw samples into each busy thread's functions, and a real
recording of a process tree (py-spy from the test extra)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hyperqwen.bench.host_cpu import host_stack_lines
from hyperqwen.bench.host_stacks import (
    comparison_lines,
    gpu_wait_share,
    parse,
    py_spy,
    sampled,
    stack_lines,
    summarize,
    thread_ms_per_step,
)

# vLLM's API server (pid 10) and its engine core (11), whose command line holds a ";"
API = 'process 10:"vllm serve";'
CORE = API + 'process 11:"python -c from vllm import run; run()";'
RAW = "\n".join([
    CORE + "thread (0x7): MainThread;run (core.py:10);step (core.py:20);build (backend.py:300) 6",
    CORE + "thread (0x7);run (core.py:10);step (core.py:21);launch (graph.py:5) 3",
    CORE + "thread (0x7): MainThread;run (core.py:10);walk (tree.py:3);walk (tree.py:4) 1",
    CORE + "thread (0x9): output;loop (io.py:1) 2",
    API + "thread (0x3): MainThread;serve (api.py:8) 4",
])  # fmt: skip


def test_samples_become_each_threads_functions_by_share() -> None:
    stacks = parse(RAW)
    assert stacks[0].pid == 11 and stacks[0].thread == "0x7"
    assert stacks[0].frames == ("run (core.py)", "step (core.py)", "build (backend.py)")
    summary = summarize(stacks, rate_hz=100)
    engine, api = summary["processes"]
    assert (engine["pid"], engine["samples"], api["pid"], api["samples"]) == (11, 12, 10, 4)
    main = engine["threads"][0]
    assert (main["thread"], main["samples"], main["seconds"]) == ("0x7", 10, 0.1)
    inclusive = dict(main["inclusive"])
    # a thread's lines with and without its name count together, both lines of step as one
    # function, and a recursive walk once per sample
    assert inclusive == {"run (core.py)": 1.0, "step (core.py)": 0.9,
                         "build (backend.py)": 0.6, "launch (graph.py)": 0.3,
                         "walk (tree.py)": 0.1}  # fmt: skip
    assert dict(main["self"]) == {"build (backend.py)": 0.6, "launch (graph.py)": 0.3,
                                  "walk (tree.py)": 0.1}  # fmt: skip
    assert engine["threads"][1]["thread"] == "0x9"
    lines = stack_lines(summary, steps=4)
    assert "thread 0x7 of pid 11, 0.10 s sampled" in lines[0]
    # build's 60 % of 0.1 s over 4 steps
    assert lines[1].split()[:3] == ["60.0%", "15.000", "ms/step"]
    assert lines[1].endswith("build (backend.py)")


def test_a_line_without_its_thread_is_refused() -> None:
    with pytest.raises(ValueError, match="not a py-spy --subprocesses --threads raw line"):
        parse('process 1:"x";main (a.py:1) 3\n')


SPINNER = """
import multiprocessing, sys, time

def spin_in_the_child(until):
    while time.monotonic() < until:
        sum(i * i for i in range(500))

if __name__ == "__main__":
    until = time.monotonic() + float(sys.argv[1])
    child = multiprocessing.get_context("spawn").Process(target=spin_in_the_child, args=(until,))
    child.start()
    print("started", flush=True)
    child.join()
"""


def test_a_recording_of_a_process_tree_finds_its_childs_busy_function(tmp_path) -> None:
    if py_spy() is None:
        pytest.fail("py-spy is part of the test extra (pyproject.toml): install it")
    script = tmp_path / "spinner.py"
    script.write_text(SPINNER)
    parent = subprocess.Popen([sys.executable, str(script), "60"], stdout=subprocess.PIPE,
                              text=True)  # fmt: skip
    try:
        assert parent.stdout.readline().strip() == "started"
        with sampled(parent.pid, tmp_path / "stacks.txt") as raw:
            time.sleep(2.0)
    finally:
        parent.kill()
        parent.wait()
    log = Path(raw).with_suffix(".log").read_text()
    assert raw.is_file(), log
    summary = summarize(parse(raw.read_text()), rate_hz=250)
    # the spinning child is the most sampled process, its main thread in the function
    busiest = summary["processes"][0]
    assert busiest["pid"] != parent.pid
    functions = dict(busiest["threads"][0]["inclusive"])
    assert any(name.startswith("spin_in_the_child ") for name in functions), functions


def test_a_recorder_that_samples_nothing_or_is_not_there_is_said(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HYPERQWEN_PY_SPY", shutil.which("true"))  # exits, writes nothing
    with sampled(os.getpid(), tmp_path / "stacks.txt") as raw:
        pass
    assert raw == tmp_path / "stacks.txt" and not raw.is_file()
    monkeypatch.setenv("HYPERQWEN_PY_SPY", str(tmp_path / "stacks.log"))  # not executable
    with pytest.raises(FileNotFoundError, match=r"HYPERQWEN_PY_SPY=.* is not an executable"):
        py_spy()
    note = {"output_tokens": 8, "stacks": None, "stacks_note": "py-spy wrote no samples: x.log"}
    assert host_stack_lines(note, []) == [
        "   host stacks: not sampled (py-spy wrote no samples: x.log)"
    ]
    assert host_stack_lines({"output_tokens": 8}, []) == []  # not asked for


def test_two_sides_compare_by_inclusive_ms_per_step_largest_difference_first() -> None:
    def side(build: float, launch: float) -> dict:
        thread = {"thread": "7", "samples": 100, "seconds": 2.0,
                  "inclusive": [["run (core.py)", 1.0], ["build (b.py)", build],
                                ["launch (g.py)", launch]], "self": []}  # fmt: skip
        stacks = {"rate_hz": 50, "processes": [{"pid": 1, "samples": 100, "threads": [thread]}]}
        return {"output_tokens": 400, "stacks": stacks}

    # 400 tokens at 2 a step: 200 steps over 2 s sampled, 10 ms a step
    stock = thread_ms_per_step(side(0.1, 0.3), tokens_per_step=2.0)
    patched = thread_ms_per_step(side(0.4, 0.2), tokens_per_step=2.0)
    assert (stock.ms, stock.gpu_wait_ms) == pytest.approx((10.0, 0.0))
    assert stock.functions == pytest.approx({"run (core.py)": 10.0, "build (b.py)": 1.0,
                                      "launch (g.py)": 3.0})  # fmt: skip
    lines = comparison_lines(stock, patched, top=2)
    names = [line.split(maxsplit=3)[3] for line in lines[1:]]
    assert names == ["(thread)", "(waiting for the GPU)", "(host work)", "build (b.py)",
                     "launch (g.py)"]  # run's is no difference  # fmt: skip
    assert lines[4].split()[:3] == ["1.000", "4.000", "+3.000"]
    assert thread_ms_per_step({"output_tokens": 4, "stacks": None}, 1.0) is None


def test_a_threads_wait_for_the_gpu_is_its_own_time_in_a_synchronize() -> None:
    runner = "GPUModelRunner._get_valid_sampled_token_count (vllm/v1/worker/gpu_model_runner.py"
    raw = "\n".join([
        CORE + f"thread (0x7);step (core.py:20);{runner}:4966) 5",
        CORE + "thread (0x7);step (core.py:20);get_output (runner.py:3);"
        "Event.synchronize (torch/cuda/streams.py:231) 2",
        # a wait function lower in the stack is not a wait: its callee was sampled
        CORE + f"thread (0x7);step (core.py:20);{runner}:4967);tolist (tensor.py:1) 1",
        CORE + "thread (0x7);step (core.py:21);launch (graph.py:5) 12",
    ])  # fmt: skip
    thread = summarize(parse(raw), rate_hz=100)["processes"][0]["threads"][0]
    assert gpu_wait_share(thread) == pytest.approx(7 / 20)
    assert (
        "0.20 s sampled, 35.0% of it waiting for the GPU"
        in stack_lines({"processes": [{"pid": 11, "threads": [thread]}]})[0]
    )
    measured = {"output_tokens": 10, "stacks": {"processes": [{"threads": [thread]}]}}
    host = thread_ms_per_step(measured, tokens_per_step=2.0)  # 5 steps over 0.2 s: 40 ms a step
    assert (host.ms, host.gpu_wait_ms) == pytest.approx((40.0, 14.0))
    lines = comparison_lines(host, host, top=1)
    assert lines[2].split()[:2] == ["14.000", "14.000"] and lines[3].split()[:2] == ["26.000"] * 2

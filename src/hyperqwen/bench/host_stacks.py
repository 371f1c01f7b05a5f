"""Where a server's host CPU goes while it decodes: py-spy samples the server's processes
(Python frames, every thread, without stopping them) during bench ab's host-CPU requests, and
the samples become each busy thread's functions by share of its time.

The profiler's host rows name torch operations, not the Python that calls them. A sample is one
thread's stack at one instant; a thread blocked in a system call is left out (py-spy's
default), so a thread's samples over the sampling rate are its time on a CPU or in a native
call (a CUDA launch, a copy) under that Python frame. A CUDA synchronize spins on a CPU by
default, so a thread that waits for the GPU is sampled while it waits: the time whose innermost
frame is one of GPU_WAITS is that wait, and a step's host work is the thread's time without
it.

py-spy (the test extra; on the GPU host a binary the run carries) is found as HYPERQWEN_PY_SPY,
beside this Python or on PATH; without it nothing is sampled, and the result says so."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from hyperqwen.bench.results import ResultFileError, load_result

SAMPLE_RATE_HZ = 250
TOP_FUNCTIONS = 60
BUSY_THREADS = 3
STOP_WAIT_S = 30.0
# Python functions whose own time (innermost frame) is a wait for the GPU: vLLM 0.26's V1 runner
# waits on an event for the previous step's accepted-token counts before it schedules (MTP
# steps), and torch's event, stream and device synchronize under anything else.
GPU_WAITS = frozenset({
    "GPUModelRunner._get_valid_sampled_token_count (vllm/v1/worker/gpu_model_runner.py)",
    "Event.synchronize (torch/cuda/streams.py)",
    "Stream.synchronize (torch/cuda/streams.py)",
    "synchronize (torch/cuda/__init__.py)",
})  # fmt: skip

# py-spy's raw format (--subprocesses --threads): one line per distinct stack,
#   process PID:"CMDLINE";[process PID:"CMDLINE";...]thread (TID): NAME;frame;...;frame COUNT
# a frame "function (file:line)"
_PROCESS = re.compile(r'process (?P<pid>\d+):".*?";(?=process \d+:|thread \()')
_THREAD = re.compile(r"thread \((?P<tid>\w+)\)(?:: [^;]*)?(?:;|$)")
_LINE_NUMBER = re.compile(r":\d+\)$")


def py_spy() -> str | None:
    """The py-spy executable: HYPERQWEN_PY_SPY, else py-spy beside this Python (a venv's
    bin, which need not be on PATH) or on PATH, else None."""
    named = os.environ.get("HYPERQWEN_PY_SPY")
    if named:
        if not os.access(named, os.X_OK):
            raise FileNotFoundError(f"HYPERQWEN_PY_SPY={named} is not an executable file")
        return named
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if os.access(beside, os.X_OK) else shutil.which("py-spy")


@contextlib.contextmanager
def sampled(pid: int, out: Path, rate_hz: int = SAMPLE_RATE_HZ) -> Iterator[Path | None]:
    """py-spy recording the process tree rooted at `pid` into `out` (raw format) for the
    body's duration; yields `out`, or None where py-spy is not there. The recorder is stopped
    with SIGINT, on which py-spy writes what it sampled."""
    executable = py_spy()
    if executable is None:
        yield None
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    command = [executable, "record", "--pid", str(pid), "--subprocesses", "--threads",
               "--nonblocking", "--rate", str(rate_hz), "--format", "raw",
               "--output", str(out)]  # fmt: skip
    log = out.with_suffix(".log").open("w")
    recorder = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield out
    finally:
        recorder.send_signal(signal.SIGINT)
        try:
            recorder.wait(timeout=STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            recorder.kill()
            recorder.wait()
        log.close()


@dataclass(frozen=True)
class Stack:
    pid: int  # the innermost process of the line
    thread: str  # its id
    frames: tuple[str, ...]  # outermost first, line numbers dropped
    count: int


def function(frame: str) -> str:
    """A frame without its line number: all lines of one function count together."""
    return _LINE_NUMBER.sub(")", frame)


def parse(raw: str) -> list[Stack]:
    """py-spy's raw lines as stacks; a line without a thread part (not --threads) is refused."""
    stacks = []
    for line in raw.splitlines():
        if not line.strip():
            continue
        body, _, count = line.rpartition(" ")
        pid = None
        while process := _PROCESS.match(body):  # a command line may hold ";"
            pid, body = int(process["pid"]), body[process.end() :]
        named = _THREAD.match(body)
        thread = named["tid"] if named else None  # py-spy names a thread on some lines only
        rest = body[named.end() :] if named else ""
        frames = [function(part) for part in rest.split(";") if part]
        if pid is None or thread is None:
            raise ValueError(f"not a py-spy --subprocesses --threads raw line: {line[:120]!r}")
        stacks.append(Stack(pid, thread, tuple(frames), int(count)))
    return stacks


def summarize(stacks: list[Stack], rate_hz: int, top: int = TOP_FUNCTIONS) -> dict:
    """Per process (most sampled first), its BUSY_THREADS most sampled threads: their sampled
    seconds, and their `top` functions by inclusive and by self share of the thread's samples
    (a recursive function counts once per sample)."""
    by_thread: dict[tuple[int, str], list[Stack]] = {}
    for stack in stacks:
        by_thread.setdefault((stack.pid, stack.thread), []).append(stack)
    by_process: dict[int, Counter] = {}
    for (pid, thread), lines in by_thread.items():
        by_process.setdefault(pid, Counter())[thread] = sum(stack.count for stack in lines)
    processes = []
    for pid, threads in sorted(by_process.items(), key=lambda item: -item[1].total()):
        busy = []
        for thread, samples in threads.most_common(BUSY_THREADS):
            inclusive, self_time = Counter(), Counter()
            for stack in by_thread[pid, thread]:
                for name in set(stack.frames):
                    inclusive[name] += stack.count
                self_time[stack.frames[-1] if stack.frames else "(no Python frame)"] += stack.count

            def shares(counter: Counter, samples: int = samples) -> list[list]:
                return [[name, round(n / samples, 4)] for name, n in counter.most_common(top)]

            busy.append({"thread": thread, "samples": samples,
                         "seconds": round(samples / rate_hz, 3),
                         "inclusive": shares(inclusive), "self": shares(self_time)})  # fmt: skip
        processes.append({"pid": pid, "samples": threads.total(), "threads": busy})
    return {"rate_hz": rate_hz, "processes": processes}


def gpu_wait_share(thread: dict) -> float:
    """The share of a summarized thread's samples spent waiting for the GPU: its functions'
    self shares in GPU_WAITS."""
    return sum(share for name, share in thread["self"] if name in GPU_WAITS)


def steps_sampled(output_tokens: int, tokens_per_step: float | None) -> float:
    """The decode steps that made `output_tokens` (one token a step without a C1 row's
    tokens per step, as host_cpu.host_cpu_rows counts them)."""
    return output_tokens / (tokens_per_step or 1.0)


def stack_lines(summary: dict, steps: float | None = None, top: int = 12) -> list[str]:
    """Printable lines of a summary: the busiest process's busiest thread and its top
    functions by self time (the frame on top of the stack; the outer frames' inclusive shares
    stay in the summary), by share of the thread's samples and, given the decode steps made
    while sampling, in ms per step."""
    if not summary.get("processes"):
        return ["   host stacks: no samples"]
    process = summary["processes"][0]
    thread = process["threads"][0]
    wait = gpu_wait_share(thread)
    lines = [f"   host stacks: thread {thread['thread']} of pid {process['pid']}, "
             f"{thread['seconds']:.2f} s sampled, {wait:.1%} of it waiting for the GPU; "
             "self time:"]  # fmt: skip
    for name, share in thread["self"][:top]:
        per_step = f"  {share * thread['seconds'] * 1000 / steps:7.3f} ms/step" if steps else ""
        lines.append(f"     {share:6.1%}{per_step}  {name[:110]}")
    return lines


@dataclass(frozen=True)
class HostThread:
    """A side's busiest thread in ms per decode step."""

    ms: float  # its whole sampled time
    gpu_wait_ms: float  # of it, waiting for the GPU
    functions: dict[str, float]  # each function's inclusive time


def thread_ms_per_step(host: Mapping, tokens_per_step: float | None) -> HostThread | None:
    """The busiest thread of a `bench ab` side's host CPU measurement (its "host_cpu") in ms
    per decode step; None without stacks."""
    stacks = host.get("stacks")
    if not stacks or not stacks["processes"] or not host.get("output_tokens"):
        return None
    thread = stacks["processes"][0]["threads"][0]
    per_step = thread["seconds"] * 1000 / steps_sampled(host["output_tokens"], tokens_per_step)
    functions = {name: share * per_step for name, share in thread["inclusive"]}
    return HostThread(per_step, gpu_wait_share(thread) * per_step, functions)


def comparison_lines(stock: HostThread, patched: HostThread, top: int) -> list[str]:
    """The thread's time, its wait for the GPU and the rest (host work), then the `top`
    functions whose inclusive ms per step differ most between the sides (a function outside
    one side's list counts 0 there: below its top)."""
    old, new = stock.functions, patched.functions

    def difference(name: str) -> float:
        return abs(new.get(name, 0.0) - old.get(name, 0.0))

    names = sorted(set(old) | set(new), key=difference, reverse=True)[:top]
    rows = [
        ("(thread)", stock.ms, patched.ms),
        ("(waiting for the GPU)", stock.gpu_wait_ms, patched.gpu_wait_ms),
        ("(host work)", stock.ms - stock.gpu_wait_ms, patched.ms - patched.gpu_wait_ms),
    ]
    rows += [(name, old.get(name, 0.0), new.get(name, 0.0)) for name in names]
    lines = [f"{'stock ms':>9} {'patched':>9} {'diff':>8}  function (inclusive, per step)"]
    for name, before, after in rows:
        lines.append(f"{before:9.3f} {after:9.3f} {after - before:+8.3f}  {name[:100]}")
    return lines


def cmd_hoststacks(args: argparse.Namespace) -> int:
    try:
        document, rows = load_result(Path(args.result))
    except ResultFileError as error:
        print(f"bench hoststacks: {error}", file=sys.stderr)
        return 2
    tokens = {row.name: row for row in rows}.get("c1_tokens_per_step")
    sides = {}
    for side in ("stock", "patched"):
        per_step = getattr(tokens, side) if tokens else None
        sides[side] = thread_ms_per_step((document.get(side) or {}).get("host_cpu") or {}, per_step)
    missing = [side for side, stacks in sides.items() if stacks is None]
    if missing:
        sides_missing = " and ".join(missing)
        why = "bench ab --profile-steps with py-spy: bench/README.md"
        print(f"bench hoststacks: {args.result} has no host stacks for {sides_missing} ({why})",
              file=sys.stderr)  # fmt: skip
        return 2
    print("\n".join(comparison_lines(sides["stock"], sides["patched"], args.top)))
    return 0


def add_subcommand(actions) -> None:
    parser = actions.add_parser(
        "hoststacks",
        help="where each side's host CPU goes, function by function (py-spy's stacks)",
        description=(
            "Compare the host stacks of a `bench ab` result (recorded with --profile-steps "
            "where py-spy is found): the busiest thread of each side's busiest process, its "
            "functions' inclusive time in ms per decode step (the C1 row's tokens per step), "
            "the functions that differ most first.\n\nExample:\n  hyperqwen bench "
            "hoststacks /tmp/hq/depth/v2.json --top 30\n\nExit codes: 0 printed, 2 no result "
            "or no stacks in it."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("result", metavar="RESULT.json", help="a `bench ab` result")
    parser.add_argument("--top", type=int, default=25, help="functions to list (default 25)")
    parser.set_defaults(func=cmd_hoststacks)

"""A server process's lifetime: start it in its own process group, wait for a healthy /health,
stop the whole group (vLLM's engine-core workers with it), and what its log says it loaded.

`bench ab` runs each side's server through it; anything else that must start a `vllm serve`
(or a stand-in) and be sure it is gone afterwards can too.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import requests
from tqdm import tqdm

SERVER_HOST = "127.0.0.1"
STOP_GRACE_S = 60
HEALTH_POLL_S = 0.5
WEIGHTS_LINE = re.compile(r"Model loading took ([0-9.]+) GiB")
Started = TypeVar("Started")


class ServerStartError(Exception):
    """The server exited or stayed unhealthy before it answered; the message ends with its log."""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((SERVER_HOST, 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def terminated_as_exit() -> Iterator[None]:
    """Inside, SIGTERM raises SystemExit (128 + 15) in the main thread, so the `finally` of each
    running server stops it: a benchmark killed with a plain `kill` would leave its servers
    holding the GPU. The previous handler comes back on exit; off the main thread, nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def exit_on_term(signum, _frame) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, exit_on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def stop_group(process: subprocess.Popen) -> None:
    """SIGINT the server's process group (vLLM shuts down cleanly), SIGKILL what lingers."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGINT)
    deadline = time.monotonic() + STOP_GRACE_S
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=STOP_GRACE_S)
    # Engine-core workers share the group and hold GPU memory until they exit too.
    while time.monotonic() < deadline:
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


@dataclass(frozen=True)
class HealthyServer:
    process: subprocess.Popen
    startup_s: float
    """From just before the start to the first 200 of /health."""


@contextlib.contextmanager
def running_server(
    command: list[str],
    env: dict[str, str] | None,
    log: Path,
    base: str,
    timeout_s: float,
    timeout_option: str = "",
) -> Iterator[HealthyServer]:
    """Start `command` (env None: this one's), its output into `log`; yield it once `base`/health
    answers 200; stop its process group.

    ServerStartError when it exits first or is not healthy within timeout_s (the message names
    `timeout_option`, the option that sets it, where given)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as sink:
        start = time.monotonic()
        process = subprocess.Popen(
            command, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            with tqdm(
                total=round(timeout_s), desc=f"waiting for {base}/health", unit="s", leave=False
            ) as bar:
                while True:
                    waited = time.monotonic() - start
                    bar.update(round(waited) - bar.n)
                    if process.poll() is not None:
                        raise ServerStartError(
                            f"the server exited with {process.returncode} before it was "
                            f"healthy; its log ({log}) ends:\n{log.read_text()[-3000:]}"
                        )
                    if waited > timeout_s:
                        hint = f" ({timeout_option})" if timeout_option else ""
                        raise ServerStartError(
                            f"not healthy after {timeout_s:g} s{hint}; log: {log}"
                        )
                    with contextlib.suppress(requests.RequestException):
                        if requests.get(f"{base}/health", timeout=5).status_code == 200:
                            break
                    time.sleep(HEALTH_POLL_S)
            yield HealthyServer(process, time.monotonic() - start)
        finally:
            stop_group(process)


@contextlib.contextmanager
def all_running(
    servers: Sequence[AbstractContextManager[Started]], keep_going: bool = False
) -> Iterator[list[Started | Exception]]:
    """Enter every server's context at once (e.g. `running_server`s: each start waits for its
    own health), yield what they yield once all are up or have failed; all stopped on exit. A
    server that fails to start: its error is raised once the others are up or have failed, or
    with keep_going it stands in the list in that server's place (the caller uses the others,
    then raises it)."""
    with contextlib.ExitStack() as stop_all:
        with ThreadPoolExecutor(max(1, len(servers))) as pool:
            starting = [pool.submit(server.__enter__) for server in servers]
        running: list[Started | Exception] = []
        for server, future in zip(servers, starting, strict=True):
            try:
                running.append(future.result())
                stop_all.push(server.__exit__)
            except Exception as error:  # stop_all stops those that started
                running.append(error)
        failures = [one for one in running if isinstance(one, Exception)]
        if failures and not keep_going:
            raise failures[0]
        yield running


def weight_gib(log_text: str) -> float | None:
    """The largest "Model loading took X GiB" of a vLLM log (one per tensor-parallel rank)."""
    found = [float(value) for value in WEIGHTS_LINE.findall(log_text)]
    return max(found) if found else None

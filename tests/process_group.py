"""Child processes that cannot outlive their test, their own children included.

When its timeout expires, subprocess.run kills only the child it started: a grandchild (pip's
build backend, a prepare under a memory probe, vLLM's bench client) runs on, orphaned, using
the machine the next tests share. Here each child leads a process group of its own, killed
whole when its test stops with it still running (a timeout, a failed assertion,
pytest-timeout's interrupt).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator, Sequence


@contextlib.contextmanager
def started(argv: Sequence[str], **popen_kwargs) -> Iterator[subprocess.Popen]:
    """subprocess.Popen(argv) in a new process group; on leaving, the group is killed unless
    the child has exited, and the child is waited for."""
    with subprocess.Popen(argv, start_new_session=True, **popen_kwargs) as process:
        try:
            yield process
        finally:
            if process.poll() is None:  # not reaped yet, so its group id is still its own
                os.killpg(process.pid, signal.SIGKILL)


def run(
    argv: Sequence[str],
    *,
    timeout: float,
    capture_output: bool = False,
    check: bool = False,
    **popen_kwargs,
) -> subprocess.CompletedProcess:
    """subprocess.run with a required timeout, killing the child's whole group when it expires
    (TimeoutExpired is raised, as from subprocess.run)."""
    if capture_output:
        popen_kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    with started(argv, **popen_kwargs) as process:
        stdout, stderr = process.communicate(timeout=timeout)
    if check and process.returncode:
        raise subprocess.CalledProcessError(process.returncode, argv, stdout, stderr)
    return subprocess.CompletedProcess(argv, process.returncode, stdout, stderr)

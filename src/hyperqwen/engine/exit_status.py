"""The API server's exit status after its engine core died: non-zero, so a supervisor restarts it.

vLLM 0.26.0 answers a dead engine core by ending every request with an error and shutting its
HTTP server down cleanly, so `vllm serve` exits 0, and systemd's Restart=on-failure (the units in
single-user/ and batch/) takes that for a deliberate stop and leaves the service down.
patches/engine-death-exit.patch records the death where vLLM decides to shut down
(`terminate_if_errored`, entrypoints/launcher.py) and exits with ENGINE_DIED_EXIT_CODE once the
server has shut down (entrypoints/cli/serve.py, the single-API-server path HyperQwen launches).
"""

from __future__ import annotations

import logging
import sys

# EX_SOFTWARE (sysexits.h): an internal error, told apart from the 1 of a bad argument.
ENGINE_DIED_EXIT_CODE = 70

_engine_died = False


def record_engine_death() -> None:
    """Called where vLLM asks its HTTP server to stop because the engine core is dead."""
    global _engine_died
    _engine_died = True


def engine_died() -> bool:
    return _engine_died


def exit_if_engine_died() -> None:
    """After the server has shut down: exit ENGINE_DIED_EXIT_CODE if the engine core died."""
    if _engine_died:
        logging.getLogger("vllm").error(
            "the engine core died; exiting with status %d so the supervisor restarts the "
            "server (systemd Restart=on-failure, compose restart: unless-stopped)",
            ENGINE_DIED_EXIT_CODE,
        )
        sys.exit(ENGINE_DIED_EXIT_CODE)

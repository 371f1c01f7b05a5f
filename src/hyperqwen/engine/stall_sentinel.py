"""Warn when requests are in flight but the engine has stopped stepping.

patches/engine-stall-sentinel.patch registers VLLM_ENGINE_STALL_SENTINEL_S (default 120 s, 0 =
off) in vllm/envs.py and, in AsyncLLM's output handler, starts one sentinel and calls
`engine_stepped()` for every batch of engine outputs it pulls. The sentinel lives in the
frontend, where engine outputs arrive, so it works whether the engine core runs in this process
or in another one. It checks from a daemon thread rather than an asyncio task, so it still
reports when this process's event loop is the thing that is stuck.

It imports the standard library only; it logs under "vllm." so vLLM's logging setup shows it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("vllm.hyperqwen.stall_sentinel")


class EngineStallSentinel:
    """Compares engine progress with the number of requests in flight.

    The output handler calls `engine_stepped()` for every batch of engine
    outputs; `check()` decides at a given moment whether there is something to
    log. The clock is injectable, so the decision can be tested without waiting.
    """

    def __init__(
        self,
        threshold_s: float,
        requests_in_flight: Callable[[], int],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if threshold_s <= 0:
            raise ValueError(
                "VLLM_ENGINE_STALL_SENTINEL_S must be a positive number of "
                f"seconds, or 0 to turn the stall sentinel off; got {threshold_s}"
            )
        self.threshold_s = threshold_s
        self.requests_in_flight = requests_in_flight
        self.clock = clock
        self.last_progress = clock()
        # Set while a stall is being reported: when it began, when we last said so.
        self.stalled_since: float | None = None
        self.last_warning = 0.0
        self._stop = threading.Event()

    def engine_stepped(self) -> None:
        self.last_progress = self.clock()

    def check(self) -> tuple[int, str] | None:
        """The (log level, message) to report now, if any."""
        now = self.clock()
        if self.stalled_since is not None and self.last_progress > self.stalled_since:
            stall_s = self.last_progress - self.stalled_since
            self.stalled_since = None
            return logging.INFO, (
                f"Engine stall over: the engine stepped again after {stall_s:.1f} s."
            )
        in_flight = self.requests_in_flight()
        if in_flight == 0:
            # An idle engine does not step: the stall clock starts anew with
            # the next request.
            self.last_progress = now
            self.stalled_since = None
            return None
        quiet_s = now - self.last_progress
        if quiet_s < self.threshold_s:
            return None
        already_warned = self.stalled_since is not None
        if already_warned and now - self.last_warning < self.threshold_s:
            return None
        self.stalled_since = self.last_progress
        self.last_warning = now
        return logging.WARNING, (
            f"Engine stall: {in_flight} request(s) in flight and no engine step "
            f"has completed for {quiet_s:.1f} s (VLLM_ENGINE_STALL_SENTINEL_S="
            f"{self.threshold_s:g}). The engine core may be hung (a GPU kernel, "
            "a collective, a stopped process) or paused, or this API process's "
            "event loop is blocked."
        )

    def start(self) -> None:
        threading.Thread(target=self._watch, name="EngineStallSentinel", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        # Four checks per threshold: a stall is reported at most 25% late.
        while not self._stop.wait(self.threshold_s / 4):
            if (report := self.check()) is not None:
                log.log(report[0], "%s", report[1])

"""EngineStallSentinel (engine/stall_sentinel.py): its decisions with a fake clock, and its thread
with the real one. The knob's registration in the patched vllm/envs.py is
tests/test_api_patches_streams.py's.
"""

from __future__ import annotations

import logging
import re
import threading
import time

import pytest

from hyperqwen.engine.stall_sentinel import EngineStallSentinel

# (event, time, requests in flight) for the sentinel with a fake clock, threshold 10 s.
THRESHOLD_S = 10.0
SCENARIO = (
    ("check", 0.0, 0),
    ("check", 100.0, 0),  # idle for 100 s: not a stall
    ("check", 101.0, 1),  # a request arrived after 100; quiet for 1 s
    ("check", 109.9, 1),
    ("check", 110.5, 1),  # 10.5 s without a step: warn
    ("check", 115.0, 2),  # still stalled, warned 4.5 s ago: quiet
    ("check", 120.5, 2),  # another threshold later: warn again
    ("step", 121.0, 2),
    ("check", 121.5, 2),  # stepped again: say so once
    ("check", 125.0, 2),
    ("step", 126.0, 2),
    ("check", 135.0, 2),  # 9 s since the last step
    ("check", 140.0, 0),  # requests done: idle resets the clock
    ("check", 149.0, 1),
)


@pytest.mark.parametrize("threshold_s", [-1.0, 0.0])
def test_a_threshold_that_is_not_positive_is_refused_naming_the_knob(threshold_s):
    with pytest.raises(ValueError) as refused:
        EngineStallSentinel(threshold_s, lambda: 0)
    assert "VLLM_ENGINE_STALL_SENTINEL_S" in str(refused.value)
    assert "0 to turn the stall sentinel off" in str(refused.value)
    assert f"got {threshold_s}" in str(refused.value)


def test_sentinel_warns_on_stalls_only_with_requests_in_flight():
    now = [0.0]
    in_flight = [0]
    sentinel = EngineStallSentinel(THRESHOLD_S, lambda: in_flight[0], lambda: now[0])
    scenario = []
    for event, at, count in SCENARIO:
        now[0], in_flight[0] = at, count
        if event == "step":
            sentinel.engine_stepped()
        else:
            report = sentinel.check()
            scenario.append(
                None if report is None else [logging.getLevelName(report[0]), report[1]]
            )
    levels = [None if entry is None else entry[0] for entry in scenario]
    assert levels == [
        None,
        None,
        None,
        None,
        "WARNING",
        None,
        "WARNING",
        "INFO",
        None,
        None,
        None,
        None,
    ]
    first, second, recovered = scenario[4][1], scenario[6][1], scenario[7][1]
    assert "1 request(s) in flight" in first
    assert "no engine step has completed for 10.5 s" in first
    assert "VLLM_ENGINE_STALL_SENTINEL_S=10" in first
    assert "2 request(s) in flight" in second
    assert "for 20.5 s" in second
    assert "stepped again after 21.0 s" in recovered


def test_sentinel_thread_reports_with_the_real_clock(engine_log):
    """A 0.2 s threshold, one request, no steps: the thread logs a warning, then, after a step,
    the recovery (INFO, which engine_log catches). Only lower bounds and self-consistency are
    asserted, never an upper time."""
    records = engine_log.records  # filled by the sentinel's thread as it logs
    live = EngineStallSentinel(0.2, lambda: 1)
    try:
        started = time.monotonic()
        live.start()
        threads = [t.name for t in threading.enumerate()]
        while not records and time.monotonic() - started < 30:
            time.sleep(0.01)
        first_report_s = time.monotonic() - started
        live.engine_stepped()
        while len(records) < 2 and time.monotonic() - started < 60:
            time.sleep(0.01)
    finally:
        live.stop()
    assert "EngineStallSentinel" in threads
    assert [r.levelname for r in records[:2]] == ["WARNING", "INFO"]
    warning = records[0].getMessage()
    assert "1 request(s) in flight" in warning
    # Not before the 0.2 s threshold had passed, and it says how long: no longer than the
    # test waited for it (both to the message's 0.1 s).
    quiet_s = float(re.search(r"has completed for ([\d.]+) s", warning)[1])
    assert 0.2 <= quiet_s <= first_report_s + 0.05
    assert first_report_s >= 0.2

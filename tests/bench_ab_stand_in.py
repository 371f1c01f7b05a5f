"""Reading what the stand-in server (tests/openai_test_server.py) logged, for the `bench ab`
run tests."""

from __future__ import annotations

import json
from pathlib import Path


def stand_in_records(log: Path, event: str) -> list[dict]:
    """What the stand-in server logged of `event`, in order: its times are CLOCK_MONOTONIC,
    one clock for every process (openai_test_server.record)."""
    prefix = '{"event": "' + event + '"'
    return [
        json.loads(line.removeprefix("STAND-IN "))
        for line in log.read_text().splitlines()
        if line.removeprefix("STAND-IN ").startswith(prefix)
    ]

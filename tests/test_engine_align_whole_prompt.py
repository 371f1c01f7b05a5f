"""A prompt that nothing cached in one prefill step under prefix caching's mamba "align" mode
(engine/align_whole_prompt.py, on the scheduler-split.patch seam), run through vLLM's own
scheduler and KV-cache manager on the CPU (align_scheduler_probe.py), with the feature off and
on: the chunks each request is prefilled in, where its cache hit starts, and (the probe's own
check) that every GDN state block the cache keeps was filled by a step ending on its boundary.

The model itself does not run on a CPU; test_engine_align_whole_prompt_gpu.py compares greedy
answers with the cache, without it and with the feature.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from hyperqwen.engine import align_whole_prompt, seams
from hyperqwen.engine.features import ALIGN_WHOLE_PROMPT

ROOT = Path(__file__).resolve().parents[1]
PROBE = Path(__file__).with_name("align_scheduler_probe.py")
BLOCK = 16  # the probe's cache block; its token budget per step is 256


def tokens(count: int, rng: random.Random) -> list[int]:
    return [rng.randrange(100, 5000) for _ in range(count)]


@pytest.fixture(scope="module")
def prefills(patched_vllm: Path, tiny_checkpoint: Path) -> dict[str, dict[str, list[list[int]]]]:
    """Each scenario's chunks per request, off (name0) and on (name1)."""
    rng = random.Random(0)
    cold = tokens(100, rng)
    system = tokens(40, rng)  # a shared system prompt: two whole blocks and 8 tokens
    shared = [system + tokens(30, rng) for _ in range(4)]
    turn = tokens(70, rng)  # a conversation: the next turn repeats this one and goes on
    scenarios = {"cold": [cold], "shared": shared, "turns": [turn, turn + tokens(30, rng)]}
    runs = {
        f"{name}{value}": {"env": {ALIGN_WHOLE_PROMPT.env: value}, "prompts": prompts}
        for name, prompts in scenarios.items()
        for value in ("0", "1")
    }
    env = {**os.environ, "PYTHONPATH": f"{patched_vllm.parent}{os.pathsep}{ROOT / 'src'}"}
    done = subprocess.run(
        [sys.executable, str(PROBE), str(tiny_checkpoint), json.dumps({"runs": runs})],
        env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_a_cold_prompt_takes_one_step_instead_of_two(prefills):
    # vLLM stops a 100-token prompt at its last block boundary (96) and runs 4 tokens more
    assert prefills["cold0"] == {"r0": [[0, 96], [96, 4]]}
    assert prefills["cold1"] == {"r0": [[0, 100]]}


def test_a_shared_prefix_is_cached_at_its_junction_and_served_from_the_third_request(prefills):
    on, off = prefills["shared1"], prefills["shared0"]
    assert on["r0"] == [[0, 70]]
    assert off["r0"] == [[0, 64], [64, 6]]  # its stop at 64 holds no state r1 can use
    # The second request finds the attention blocks of the shared 32 tokens cached without a
    # state: vLLM's junction, where both stop; from then on the state there is served.
    for run in (on, off):
        assert run["r1"] == [[0, 32], [32, 32], [64, 6]]
        assert run["r2"] == run["r3"] == [[32, 32], [64, 6]]


def test_a_request_starting_from_a_hit_keeps_vllms_stops(prefills):
    """A conversation's next turn: with vLLM's stop the first turn left its state at 64, so the
    next turn starts there; with the feature the first turn ran whole and left none, so the
    next turn finds the junction at 64, caches it and runs on from it (the trade: a second
    turn that does not reach the first turn's next block boundary recomputes it)."""
    assert prefills["turns0"] == {"r0": [[0, 64], [64, 6]], "r1": [[64, 32], [96, 4]]}
    assert prefills["turns1"] == {"r0": [[0, 70]], "r1": [[0, 64], [64, 32], [96, 4]]}


@pytest.mark.parametrize(
    ("start", "boundary", "wanted", "expected"),
    [
        (0, 0, 100, 100),  # cold, finishes: whole
        (0, 0, 90, 64),  # cold, the budget ends it first: vLLM's split
        (0, 32, 100, 64),  # a shared-prefix junction to cache: vLLM's split
        (32, 0, 68, 64),  # starts from a hit: vLLM's split
    ],
)
def test_which_chunks_run_whole(start, boundary, wanted, expected):
    request = SimpleNamespace(num_tokens=100, shared_prefix_boundary=boundary)
    assert align_whole_prompt.scheduler_mamba_split(request, start, wanted, 64) == expected


def test_the_seam_is_vllms_split_unless_the_switch_is_1(monkeypatch):
    request = SimpleNamespace(num_tokens=100, shared_prefix_boundary=0)
    monkeypatch.delenv(ALIGN_WHOLE_PROMPT.env, raising=False)
    assert seams.scheduler_mamba_split(request, 0, 100, 96) == 96
    monkeypatch.setenv(ALIGN_WHOLE_PROMPT.env, "1")
    assert seams.scheduler_mamba_split(request, 0, 100, 96) == 100

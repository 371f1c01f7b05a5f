"""mamba-align-retire.patch: one long prompt through vLLM's own async scheduler and KV-cache
manager on the CPU (align_retire_probe.py), in prefix caching's mamba "align" mode with MTP's
speculative state blocks and a step in flight, in a pool that holds the prompt's attention
blocks and the state blocks it needs. Pristine vLLM 0.26 keeps one state block per prefill chunk
and preempts the request; with the series the request holds the blocks it needs, which are one
more than vLLM counts (capacity.PoolLayout.prefill_state_blocks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROBE = Path(__file__).with_name("align_retire_probe.py")
SPECULATIVE = 3  # the probe's drafts
# the running state, the speculative blocks, the state of the chunk before and the one in flight
NEEDED_STATE_BLOCKS = 1 + SPECULATIVE + 2


def probe(vllm_dir: Path, checkpoint: Path, state_blocks: int) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{vllm_dir.parent}{os.pathsep}{ROOT / 'src'}"}
    done = subprocess.run(
        [sys.executable, str(PROBE), str(checkpoint), str(state_blocks)],
        env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def pristine(pristine_vllm_dir: Path, tiny_checkpoint: Path) -> dict:
    return probe(pristine_vllm_dir, tiny_checkpoint, NEEDED_STATE_BLOCKS)


@pytest.fixture(scope="module")
def patched(patched_vllm: Path, tiny_checkpoint: Path) -> dict:
    return probe(patched_vllm, tiny_checkpoint, NEEDED_STATE_BLOCKS)


def test_pristine_vllm_keeps_a_state_block_per_chunk_and_preempts(pristine) -> None:
    # the probe's pool is tight enough to show the leak: the day this fails, the pin has the
    # upstream fix and the patch retires (its preamble)
    assert pristine["most_state_blocks"] > 2 * NEEDED_STATE_BLOCKS
    assert pristine["preemptions"] > 0


def test_with_the_series_the_prompt_holds_only_the_state_it_needs(patched) -> None:
    assert patched["finished"]
    assert patched["preemptions"] == 0
    assert patched["most_state_blocks"] <= NEEDED_STATE_BLOCKS


def test_the_pool_vllm_counts_is_one_state_block_short(patched_vllm, tiny_checkpoint) -> None:
    # vLLM's count: the running state, the last cached one and the speculative blocks; the
    # state of the chunk in flight does not fit, and the prompt is preempted over and over
    short = probe(patched_vllm, tiny_checkpoint, 2 + SPECULATIVE)
    assert short["preemptions"] > 1

"""`hyperqwen bench sass`: the W4A16 kernel compiled here for sm80-90 (Triton, no GPU) and its main
loop counted in the SASS Triton's cuobjdump prints; guards what the kernels README states.

The command runs in its own Python: the test session sets TRITON_INTERPRET=1 (conftest), under
which Triton interprets kernels instead of compiling them."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def sass(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [sys.executable, "-m", "hyperqwen.cli", "bench", "sass", "--json", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


def test_the_mma_tile_loads_by_16_byte_copies_and_issues_few_ops_per_code():
    done = sass("--block-n", "64", "--warps", "2", "--arch", "86", "90")
    assert done.returncode == 0, done.stderr[-2000:]
    for count in json.loads(done.stdout):
        assert count["config"] == "n64_k256_s1_w2_p3"
        assert count["ops"]["HMMA"] == 64  # 4 pair planes x 2 groups x the tile's mma.sync
        # words and x come by 16-byte cp.async; only the two groups' scales are plain loads
        assert count["loads"] == {"LDGSTS.E.BYPASS.128": 16, "LDG.E.U16": 2}, count["arch"]
        assert 2.5 < count["lane_ops_per_code"] < 4.0
        assert count["shared_bytes"] > 0


def test_the_wgmma_tile_copies_x_straight_to_shared_memory():
    """Each pair plane's x slice is its own load: no 2-byte re-layout through shared memory."""
    done = sass("--block-n", "64", "--warps", "4")
    assert done.returncode == 0, done.stderr[-2000:]
    (count,) = json.loads(done.stdout)
    assert count["arch"] == 90 and count["ops"].get("HGMMA", 0) > 0
    # the re-layout it replaced stored and reloaded x 2 bytes at a time: 32 STS + 32 LDS
    assert "STS" not in count["ops"] and count["ops"].get("LDS", 0) <= 4
    assert count["loads"].get("LDGSTS.E.64", 0) > 0


def test_it_refuses_to_run_interpreted():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "hyperqwen.cli", "bench", "sass"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2 and "unset TRITON_INTERPRET" in done.stderr

"""`hyperqwen capacity`: the card's context per KV-cache dtype, from the launcher's own
arithmetic (capacity.py), through the real CLI."""

from __future__ import annotations

import re

import pytest
from cli_runner import hyperqwen

from hyperqwen.capacity import KV_CACHE_DTYPES


def table(text: str) -> dict[str, list[int]]:
    """KV dtype -> [block tokens, max len at 1, 2, 4 slots]."""
    rows = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if cells[0] in KV_CACHE_DTYPES:
            rows[cells[0]] = [int(cell.replace(",", "")) for cell in cells[1:]]
    return rows


def capacity(tmp_path, *args: str, **knobs: str) -> str:
    env = {"MODELS_DIR": str(tmp_path / "no-models"), **knobs}
    done = hyperqwen("capacity", *args, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_every_kv_dtype_is_sized_and_smaller_entries_hold_more(tmp_path):
    out = capacity(tmp_path, "--card-gib", "24")
    assert "a 24 GiB card, GPU_UTIL 0.9" in out and "the prepared 27B's" in out
    rows = table(out)
    assert set(rows) == set(KV_CACHE_DTYPES)
    assert rows["fp8"][0] == 1600  # the block tests/test_capacity.py works out by hand
    assert rows["int4_per_token_head"][1] > rows["fp8"][1] > rows["auto"][1] > 0
    for block, *lengths in rows.values():
        assert lengths == sorted(lengths, reverse=True)  # more slots, shorter requests
        assert all(length % block == 0 for length in lengths)


def test_a_larger_card_and_a_larger_share_hold_more(tmp_path):
    small = table(capacity(tmp_path, "--card-gib", "24"))
    large = table(capacity(tmp_path, "--card-gib", "32"))
    shared = table(capacity(tmp_path, "--card-gib", "24", GPU_UTIL="0.8"))
    for kv in KV_CACHE_DTYPES:
        assert large[kv][1] > small[kv][1] > shared[kv][1], kv


def test_what_speculation_and_ctx_change_is_said(tmp_path):
    out = capacity(tmp_path, "--card-gib", "24", SPEC="off", CTX="huge")
    assert re.search(r"\(0 draft tokens, prefix caching on, float32 state\)", out)


@pytest.mark.parametrize("bad", ["0", "-3", "lots"])
def test_a_card_size_that_is_not_one_is_refused(tmp_path, bad):
    done = hyperqwen("capacity", "--card-gib", bad, env={}, cwd=tmp_path)
    assert done.returncode == 2
    assert "--card-gib" in done.stderr

"""`hyperqwen capacity`: the card's context per KV-cache dtype, from the launcher's own
arithmetic (capacity.py), through the real CLI."""

from __future__ import annotations

import re
from typing import get_args

import pytest
from cli_runner import hyperqwen

from hyperqwen.kv_choices import KV_CACHE_DTYPES
from hyperqwen.settings import StateDtype


def table(text: str) -> dict[str, list[int]]:
    """KV dtype -> [block tokens, max len at 1, 2, 4 slots]."""
    return {kv: [int(cell.replace(",", "")) for cell in cells[:-1]] for kv, cells in rows(text)}


def serves(text: str) -> dict[str, str]:
    """KV dtype -> the last column: whether it serves with the SPEC asked."""
    return {kv: cells[-1] for kv, cells in rows(text)}


def rows(text: str) -> list[tuple[str, list[str]]]:
    found = []
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if cells[0] in KV_CACHE_DTYPES:
            found.append((cells[0], cells[1:]))
    return found


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


def test_turboquant_is_marked_refused_with_speculation_only(tmp_path):
    with_mtp = capacity(tmp_path, "--card-gib", "24")
    assert "| serves with SPEC=mtp |" in with_mtp
    assert serves(with_mtp) == {
        kv: "no: refused" if kv.startswith("turboquant_") else "yes" for kv in KV_CACHE_DTYPES
    }
    without = capacity(tmp_path, "--card-gib", "24", SPEC="off")
    assert set(serves(without).values()) == {"yes"}
    # no drafts: fewer state blocks a slot, so TurboQuant's one slot holds more than with MTP
    assert table(without)["turboquant_4bit_nc"][1] > table(with_mtp)["turboquant_4bit_nc"][1]


def test_what_speculation_and_ctx_change_is_said(tmp_path):
    out = capacity(tmp_path, "--card-gib", "24", SPEC="off", CTX="huge")
    assert re.search(r"\(0 draft tokens, prefix caching on, float32 state\)", out)


@pytest.mark.parametrize("bad", ["0", "-3", "lots"])
def test_a_card_size_that_is_not_one_is_refused(tmp_path, bad):
    done = hyperqwen("capacity", "--card-gib", bad, env={}, cwd=tmp_path)
    assert done.returncode == 2
    assert "--card-gib" in done.stderr


def residency(text: str) -> dict[str, list[float]]:
    """State dtype -> [MiB a request, requests resident at each BATCH_REQUEST_TOKENS length]."""
    found = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        dtype = cells[0].removesuffix(" (this setup)")
        if dtype in get_args(StateDtype):
            found[dtype] = [float(cell.replace(",", "")) for cell in cells[1:]]
    return found


def test_batch_residency_per_state_dtype(tmp_path):
    small = capacity(tmp_path, "--mode", "batch", "--card-gib", "24")
    h200 = capacity(tmp_path, "--mode", "batch", "--card-gib", "140")
    assert "| bfloat16 (this setup) |" in small  # the batch profile's own
    assert "KV cache (fp8)" in small and "prefix caching on" in small
    assert "resident at 640 tokens" in small and "C64 or C256" in small
    for out in (small, h200):
        rows = residency(out)
        assert set(rows) == set(get_args(StateDtype))
        assert rows["bfloat16"] == rows["float16"]  # the same bytes
        # the tests/test_capacity.py by-hand state, and twice it (and more) in float32
        assert rows["bfloat16"][0] == 150.0 and rows["float32"][0] == 294.0
        for counts in rows.values():
            assert counts[1:] == sorted(counts[1:], reverse=True)  # longer requests, fewer
        assert rows["bfloat16"][1] > rows["float32"][1] > 0
    assert residency(h200)["bfloat16"][1] > residency(small)["bfloat16"][1]


def test_batch_residency_follows_the_knobs(tmp_path):
    out = capacity(tmp_path, "--mode", "batch", "--card-gib", "24", STATE_DTYPE="float16")
    assert "| float16 (this setup) |" in out
    kv = capacity(tmp_path, "--mode", "batch", "--card-gib", "24", KV="auto")
    assert "KV cache (auto)" in kv
    # a bf16 KV cache a token costs twice fp8's: fewer 32k requests resident
    assert residency(kv)["bfloat16"][3] <= residency(out)["bfloat16"][3]


def test_the_tables_are_at_the_step_serve_takes_and_its_line_follows(tmp_path):
    """On a 24 GiB card CTX=fast and batch fit only at fewer tokens a step than their
    profiles' 8,192: the tables are sized there, and the last line is what serve starts with."""
    for mode in ("single", "batch"):
        out = capacity(tmp_path, "--mode", mode, "--card-gib", "24")
        assert "at 2,048 tokens a step: " in out
        last = out.strip().splitlines()[-1]
        assert last.startswith(f"hyperqwen serve {mode} starts with: ")
        assert "this card holds" in last and "Steps of at most 2,048 tokens" in last
    on_h200 = capacity(tmp_path, "--card-gib", "141")
    assert "at 8,192 tokens a step: " in on_h200 and "Steps of at most" not in on_h200
    refused = capacity(tmp_path, "--card-gib", "24", MAX_LEN="200000")
    assert (
        refused.strip()
        .splitlines()[-1]
        .startswith("hyperqwen serve single would refuse: MAX_LEN=200000 does not fit")
    )


def test_a_combination_serve_refuses_still_gets_its_table(tmp_path):
    out = capacity(tmp_path, "--card-gib", "24", KV="turboquant_4bit_nc")
    assert serves(out)["turboquant_4bit_nc"] == "no: refused"
    last = out.strip().splitlines()[-1]
    assert last.startswith(
        "hyperqwen serve single would refuse: KV=turboquant_4bit_nc cannot serve with SPEC=mtp"
    )


def kvarn_cells(text: str) -> list[str]:
    (line,) = [line for line in text.splitlines() if line.startswith("| kvarn |")]
    return [cell.strip() for cell in line.strip().strip("|").split("|")][1:]


def test_kvarn_has_its_row_at_the_step_it_serves_with(tmp_path):
    """KVarN's blocks are whole 128-token tiles larger than the 2,048-token step the launcher
    takes for fp8 on a 24 GiB card, so its row is at the step that holds one block, less its
    side cache; at one slot it is what `hyperqwen serve` with KV=kvarn takes (rounded down)."""
    out = capacity(tmp_path, "--card-gib", "24", CTX="huge")
    block, *lengths = [int(cell.replace(",", "")) for cell in kvarn_cells(out)[:-1]]
    assert block % 128 == 0 and block > 2048
    assert lengths == sorted(lengths, reverse=True) and lengths[0] > table(out)["fp8"][1]
    assert "kvarn: HyperQwen's 4-bit K / 2-bit V cache" in out and "at 4,096 tokens a step" in out
    served = capacity(tmp_path, "--card-gib", "24", CTX="huge", KV="kvarn")
    holds = int(re.search(r"this card holds ([\d,]+) tokens at 1 slot", served)[1].replace(",", ""))
    assert holds == lengths[0] // 1024 * 1024


def test_kvarn_row_sizes_the_value_bits_of_kvarn_v_bits(tmp_path):
    """KVARN_V_BITS=3: kvarn's row sizes tiles of 3-bit values (more bytes a token, so less
    context at each slot count) and its footnote says so; the other rows stay as they were."""
    two = capacity(tmp_path, "--card-gib", "24", CTX="huge")
    three = capacity(tmp_path, "--card-gib", "24", CTX="huge", KVARN_V_BITS="3")
    lengths = [[int(c.replace(",", "")) for c in kvarn_cells(out)[1:-1]] for out in (two, three)]
    assert all(t <= s for s, t in zip(*lengths, strict=True)), lengths
    assert 0.75 * lengths[0][0] < lengths[1][0] < lengths[0][0], lengths  # at one slot
    assert "kvarn: HyperQwen's 4-bit K / 3-bit V cache" in three
    assert table(three) == table(two)


@pytest.mark.parametrize("knobs", [{"SPEC": "ngram"}, {"DRAFT_TOKENS": "4"}])
def test_kvarn_is_marked_refused_where_serve_refuses_it(tmp_path, knobs):
    assert kvarn_cells(capacity(tmp_path, "--card-gib", "24", **knobs))[-1] == "no: refused"
    assert kvarn_cells(capacity(tmp_path, "--card-gib", "24"))[-1] == "yes"

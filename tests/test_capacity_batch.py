"""Batch mode sized to the card: its requests share the pool, so the longest request is what one
alone holds and the slots are as many requests of BATCH_SIZING_TOKENS as stay resident (up to
the profile's 64); knob values vLLM would refuse at start are refused before it, by name."""

from __future__ import annotations

import pytest
from loaded_settings import loaded
from test_capacity_launch import ASSUMED, G27, H200, RTX_4090, flag

from hyperqwen.capacity import (
    CacheSetup,
    Capacity,
    card_pool_bytes,
    pool_layout,
)
from hyperqwen.capacity_fit import (
    BATCH_SIZING_TOKENS,
    MIN_BATCHED_TOKENS,
    CapacityRefusal,
)
from hyperqwen.launch import BATCH_PROFILE, build_launch


def batch_capacity(machine, tokens: int = BATCH_PROFILE.max_batched_tokens) -> Capacity:
    """The pool batch mode sizes from: its fp8 KV, bf16 state, no drafts, prefix caching, at
    `tokens` a step."""
    setup = CacheSetup(BATCH_PROFILE.kv_cache_dtype, BATCH_PROFILE.ssm_cache_dtype, 0, 0, True)
    pool, _ = card_pool_bytes(machine, 0.9, tokens)
    return Capacity(pool_layout(G27, setup), pool)


def test_a_card_that_holds_the_profile_keeps_its_numbers():
    plain = build_launch(loaded(), "batch", api_key=None)
    sized = build_launch(loaded(), "batch", api_key=None, machine=H200)
    assert sized.argv == plain.argv
    (line,) = [notice for notice in sized.notices if "this card holds" in notice]
    resident = batch_capacity(H200).slots(BATCH_SIZING_TOKENS)
    assert resident > BATCH_PROFILE.max_seqs
    assert line.startswith(f"batch: this card holds {resident:,} requests of 2,048 tokens")
    assert "(MAX_LEN 150000, MAX_SEQS 64)" in line


def test_a_24_gb_card_takes_what_fits():
    """150,000 tokens is more than the pool beside the 27B holds for one request, and 64
    sequences more than stay resident (vLLM refuses the length at start), even at 2,048 tokens
    a step, which the launch takes for the room it leaves."""
    assert not batch_capacity(RTX_4090).fits(BATCH_PROFILE.max_len, 1)
    capacity = batch_capacity(RTX_4090, MIN_BATCHED_TOKENS)
    assert not capacity.fits(BATCH_PROFILE.max_len, 1)
    resident = capacity.slots(BATCH_SIZING_TOKENS)
    assert batch_capacity(RTX_4090).slots(BATCH_SIZING_TOKENS) < resident < BATCH_PROFILE.max_seqs
    plan = build_launch(loaded(), "batch", api_key=None, machine=RTX_4090)
    assert flag(plan.argv, "--max-num-batched-tokens") == str(MIN_BATCHED_TOKENS)
    longest = int(flag(plan.argv, "--max-model-len"))
    assert longest == capacity.max_len(1) // 1024 * 1024
    assert capacity.fits(longest, 1) and not capacity.fits(longest + 1024, 1)
    seqs = int(flag(plan.argv, "--max-num-seqs"))
    assert seqs == resident
    assert capacity.fits(BATCH_SIZING_TOKENS, seqs)
    assert seqs <= capacity.blocks  # vLLM's check before it captures FULL decode graphs


def test_max_seqs_between_resident_and_the_blocks_is_taken():
    capacity = batch_capacity(RTX_4090, MIN_BATCHED_TOKENS)
    wanted = capacity.slots(BATCH_SIZING_TOKENS) + 1
    assert wanted <= capacity.blocks
    argv = build_launch(loaded(MAX_SEQS=str(wanted)), "batch", None, machine=RTX_4090).argv
    assert flag(argv, "--max-num-seqs") == str(wanted)


def test_max_seqs_beyond_the_blocks_is_refused_naming_the_knob():
    blocks = batch_capacity(RTX_4090, MIN_BATCHED_TOKENS).blocks  # the floor has the most
    build_launch(loaded(MAX_SEQS=str(blocks)), "batch", None, machine=RTX_4090)
    more = blocks + 1
    refusal = rf"^MAX_SEQS={more} does not fit: .* {blocks} blocks"
    with pytest.raises(CapacityRefusal, match=refusal):
        build_launch(loaded(MAX_SEQS=str(more)), "batch", None, machine=RTX_4090)


def test_a_max_len_one_request_cannot_hold_is_refused_naming_the_knob():
    with pytest.raises(CapacityRefusal, match=r"^MAX_LEN=150000 does not fit: .*Set MAX_LEN="):
        build_launch(loaded(MAX_LEN="150000"), "batch", None, machine=RTX_4090)


def test_a_card_without_room_for_the_weights_refuses_batch():
    card_16gb = type(RTX_4090)(16_376 * 2**20, "RTX 4080", G27, RTX_4090.weight_bytes, "27B")
    with pytest.raises(CapacityRefusal, match=r"^batch does not fit: .* leaves 0\.00 GiB"):
        build_launch(loaded(), "batch", None, machine=card_16gb)


def test_an_assumed_card_sizes_and_warns_instead_of_refusing():
    plan = build_launch(loaded(), "batch", None, machine=ASSUMED)
    resident = batch_capacity(ASSUMED, MIN_BATCHED_TOKENS).slots(BATCH_SIZING_TOKENS)
    assert int(flag(plan.argv, "--max-num-seqs")) == resident
    refused = build_launch(loaded(MAX_SEQS="500"), "batch", None, machine=ASSUMED)
    assert flag(refused.argv, "--max-num-seqs") == "500"
    (warning,) = refused.warnings
    assert warning.startswith("MAX_SEQS=500 does not fit")

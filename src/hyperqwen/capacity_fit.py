"""What a launch takes on this card: MAX_LEN, MAX_SEQS and tokens per step for a profile, from
capacity.py's arithmetic of vLLM's pool.

Single mode keeps every slot able to hold a full-length request (fewer slots first, then a
shorter length); batch mode's requests share the pool (the longest one alone, the slots that
stay resident at BATCH_SIZING_TOKENS). Before either shrinks, fewer tokens per step are tried,
since vLLM's profile run reserves activations for a whole step. Knob values that cannot fit
are refused by name (CapacityRefusal), with what fits and the fix.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hyperqwen.capacity import (
    CacheSetup,
    Capacity,
    Machine,
    card_pool_bytes,
    gib,
    kv_mem_bytes,
    kvarn_side_bytes,
    pool_layout,
    state_terms,
)
from hyperqwen.kv_choices import KVARN_CHOICE
from hyperqwen.settings import Settings, SettingsError


class CapacityRefusal(SettingsError):
    """Knob values that cannot fit the card; the message names the knob, what fits, the fix."""


# Derived lengths are rounded down to whole KiB-tokens; MAX_LEN's own lower bound is the least.
LEN_STEP = 1024
MIN_MAX_LEN = next(
    bound.ge for bound in Settings.model_fields["MAX_LEN"].metadata if hasattr(bound, "ge")
)


# Batch mode's slots are as many requests of this length (a prompt and its answer, as an API
# backend sees them) as stay resident at once, up to the profile's.
BATCH_SIZING_TOKENS = 2048


# Where a profile's numbers do not fit at its tokens per step (max_num_batched_tokens, which the
# profile run's activations grow with), the launcher halves that budget down to this before it
# cuts slots or length: a prefill step of 2,048 tokens still multiplies every weight by 2,048
# rows. What it costs in prefill speed is not measured, and the reserve there is extrapolated
# from ACTIVATION_SCALE's one calibration (tests/test_capacity_gpu.py -k sized checks it).
MIN_BATCHED_TOKENS = 2048


@dataclass(frozen=True)
class ContextFit:
    max_len: int
    max_seqs: int
    line: str  # the startup line: what this card holds
    batched_tokens: int  # vLLM's tokens per step the fit was worked out at


def _card_capacity(
    machine: Machine,
    settings: Settings,
    setup: CacheSetup,
    profile: tuple[int, int],
    batched_tokens: int,
) -> tuple[Capacity, str]:
    """The pool this launch will get (KV_MEM's, else what the card leaves) and a phrase
    saying how it was worked out."""
    if settings.KV_MEM:
        pool, how = kv_mem_bytes(settings.KV_MEM), f"KV_MEM={settings.KV_MEM}"
    else:
        pool, how = card_pool_bytes(
            machine, settings.GPU_UTIL, batched_tokens, setup.tensor_parallel
        )
        if setup.kv_cache_dtype == KVARN_CHOICE:
            # sized for the most sequences this launch can choose: never short
            seqs = settings.MAX_SEQS or profile[1]
            side = kvarn_side_bytes(machine.geometry, setup, seqs, batched_tokens)
            pool -= side
            how += f" - {gib(side)} GiB KVarN side cache ({seqs} sequences) and prefill scratch"
    capacity = Capacity(pool_layout(machine.geometry, setup), pool)
    room = (
        f"{how} leaves {gib(max(pool, 0))} GiB for the KV cache ({setup.kv_name}) and "
        f"recurrent state ({state_terms(setup)})"
    )
    return capacity, room


def fit_to_card(
    machine: Machine,
    settings: Settings,
    setup: CacheSetup,
    profile: tuple[int, int],
    batched_tokens: int,
) -> ContextFit:
    """MAX_LEN and MAX_SEQS for a single-mode CTX profile: the knobs the user set, else the
    profile's (max_len, slots) where they fit, else what does: fewer slots first, then a
    shorter length at one slot. Every slot can hold a full-length request at once, so no
    request is ever preempted for cache space. CapacityRefusal when the knobs set cannot fit."""
    capacity, room = _card_capacity(machine, settings, setup, profile, batched_tokens)
    max_len, max_seqs = _choose(capacity, room, settings, profile)
    line = (
        f"this card holds {max_len:,} tokens at {max_seqs} slot{'s' * (max_seqs > 1)} "
        f"(MAX_LEN {max_len}, MAX_SEQS {max_seqs}): {room}. vLLM should log 'GPU KV cache "
        f"size: {capacity.vllm_tokens(max_len):,} tokens' and "
        f"{capacity.vllm_concurrency(max_len):.2f}x concurrency."
    )
    return ContextFit(max_len, max_seqs, line, batched_tokens)


def fit_batch_to_card(
    machine: Machine,
    settings: Settings,
    setup: CacheSetup,
    profile: tuple[int, int],
    batched_tokens: int,
) -> ContextFit:
    """MAX_LEN and MAX_SEQS for batch mode, whose requests share the pool: the longest request
    is what one alone can hold (the profile's length where it fits), and the slots are the
    profile's where that many requests of BATCH_SIZING_TOKENS stay resident at once, else as
    many as do (at least one); longer requests wait or are preempted, as vLLM schedules them.
    CapacityRefusal for a MAX_LEN one request cannot hold, or a MAX_SEQS beyond the pool's
    blocks (vLLM refuses a FULL decode graph for more sequences than blocks)."""
    capacity, room = _card_capacity(machine, settings, setup, profile, batched_tokens)
    one_slot = capacity.max_len(1)
    if settings.MAX_LEN and not capacity.fits(settings.MAX_LEN, 1):
        raise CapacityRefusal(
            f"MAX_LEN={settings.MAX_LEN} does not fit: {room}, which holds {one_slot:,} tokens "
            f"for a request alone. Set MAX_LEN={_rounded(one_slot)} or less (unset, batch takes "
            f"what fits), or {_more_room(settings)}."
        )
    max_len = settings.MAX_LEN or (
        profile[0] if capacity.fits(profile[0], 1) else _rounded(one_slot)
    )
    if max_len < MIN_MAX_LEN:
        raise CapacityRefusal(
            f"batch does not fit: {room}, not even {MIN_MAX_LEN} tokens for one request. "
            f"{_no_room_fix(settings)}"
        )
    if (settings.MAX_SEQS or 0) > capacity.blocks:
        raise CapacityRefusal(
            f"MAX_SEQS={settings.MAX_SEQS} does not fit: {room}, which is {capacity.blocks} "
            "blocks, and vLLM keeps one for each decoding sequence. Set MAX_SEQS="
            f"{capacity.blocks} or less (unset, batch takes the "
            f"{capacity.slots(BATCH_SIZING_TOKENS)} requests of {BATCH_SIZING_TOKENS:,} tokens "
            f"that stay resident), or {_more_room(settings)}."
        )
    resident = capacity.slots(BATCH_SIZING_TOKENS)
    max_seqs = settings.MAX_SEQS or max(1, min(profile[1], resident))
    line = (
        f"this card holds {resident:,} requests of {BATCH_SIZING_TOKENS:,} tokens at once and "
        f"one of up to {one_slot:,} (MAX_LEN {max_len}, MAX_SEQS {max_seqs}): {room}. vLLM "
        f"should log 'GPU KV cache size: {capacity.vllm_tokens(max_len):,} tokens'."
    )
    return ContextFit(max_len, max_seqs, line, batched_tokens)


def step_budgets(profile_tokens: int, block_tokens: int) -> list[int]:
    """The tokens per step to try: the profile's, then halves down to MIN_BATCHED_TOKENS, never
    below one attention block (prefix caching's align mode ends each prefill chunk on one)."""
    budgets = [profile_tokens]
    while budgets[-1] // 2 >= max(MIN_BATCHED_TOKENS, block_tokens):
        budgets.append(budgets[-1] // 2)
    return budgets


def fit_in_fewer_step_tokens(
    fit_to: Callable[[Machine, Settings, CacheSetup, tuple[int, int], int], ContextFit],
    machine: Machine,
    settings: Settings,
    setup: CacheSetup,
    profile: tuple[int, int],
    profile_tokens: int,
) -> ContextFit:
    """`fit_to` (fit_to_card or fit_batch_to_card) at the largest step budget that holds what
    is asked (the knobs, else the profile's length and slots), else at the smallest, which
    holds the most; CapacityRefusal only when even the smallest cannot hold the knobs. With
    KV_MEM the pool is fixed whatever the step, so the profile's step stays."""
    wanted = (settings.MAX_LEN or profile[0], settings.MAX_SEQS or profile[1])
    budgets = step_budgets(profile_tokens, pool_layout(machine.geometry, setup).block_tokens)
    if settings.KV_MEM:
        budgets = budgets[:1]
    for tokens in budgets[:-1]:
        try:
            fit = fit_to(machine, settings, setup, profile, tokens)
        except CapacityRefusal:
            continue
        if (fit.max_len, fit.max_seqs) == wanted:
            return fit
    return fit_to(machine, settings, setup, profile, budgets[-1])


def _choose(
    capacity: Capacity, room: str, settings: Settings, profile: tuple[int, int]
) -> tuple[int, int]:
    length, slots = settings.MAX_LEN, settings.MAX_SEQS
    one_slot = capacity.max_len(1)
    if length and slots:
        if capacity.fits(length, slots):
            return length, slots
        raise CapacityRefusal(
            f"MAX_LEN={length} with MAX_SEQS={slots} does not fit: {room}, which holds "
            f"{capacity.max_len(slots):,} tokens at {slots} slots, or {capacity.slots(length)} "
            f"slots of {length:,} tokens. Lower MAX_LEN or MAX_SEQS, or {_more_room(settings)}."
        )
    if length:
        if capacity.fits(length, 1):
            return length, min(profile[1], capacity.slots(length))
        raise CapacityRefusal(
            f"MAX_LEN={length} does not fit: {room}, which holds {one_slot:,} tokens at 1 slot. "
            f"Set MAX_LEN={_rounded(one_slot)} or less (unset, CTX={settings.CTX} takes what "
            f"fits), or {_more_room(settings)}."
        )
    if slots:
        fitted = _rounded(min(profile[0], capacity.max_len(slots)))
        if fitted >= MIN_MAX_LEN:
            return fitted, slots
        raise CapacityRefusal(
            f"MAX_SEQS={slots} does not fit: {room}, which holds {capacity.max_len(slots):,} "
            f"tokens per slot at {slots} slots and {one_slot:,} at 1 slot. Lower MAX_SEQS (or "
            f"unset it), or {_more_room(settings)}."
        )
    if capacity.fits(profile[0], 1):
        return profile[0], min(profile[1], capacity.slots(profile[0]))
    if _rounded(one_slot) >= MIN_MAX_LEN:
        return _rounded(one_slot), 1
    raise CapacityRefusal(
        f"CTX={settings.CTX} does not fit: {room}, not even {MIN_MAX_LEN} tokens at 1 slot. "
        f"{_no_room_fix(settings)}"
    )


def _more_room(settings: Settings) -> str:
    """The knob that gives the cache more room: KV_MEM where it fixes the pool (GPU_UTIL then
    sizes nothing), else GPU_UTIL."""
    return "raise KV_MEM" if settings.KV_MEM else "raise GPU_UTIL"


def _no_room_fix(settings: Settings) -> str:
    if settings.KV_MEM:
        return "Raise KV_MEM."
    return "Raise GPU_UTIL, free the card of other processes, or serve on a larger card."


def _rounded(length: int) -> int:
    return length // LEN_STEP * LEN_STEP if length >= LEN_STEP else length

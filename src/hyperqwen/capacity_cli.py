"""`hyperqwen capacity`: how much context a card holds, per KV-cache dtype, before serving;
with --mode batch, how many requests the batch profile keeps resident, per GDN state dtype.

The same arithmetic `hyperqwen serve` sizes its profiles with (capacity.py): the card's
memory x GPU_UTIL, less the weights and the estimated reserve, cut into vLLM's hybrid blocks.
Computed, not measured: the reserve for activations, CUDA graphs and workspaces is an estimate
until tests/test_capacity_gpu.py has checked it on a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from dataclasses import replace
from pathlib import Path
from typing import get_args

from hyperqwen.capacity import (
    CacheSetup,
    Capacity,
    GiB,
    Machine,
    MiB,
    card_pool_bytes,
    kvarn_side_bytes,
    pool_layout,
    state_terms,
)
from hyperqwen.capacity_fit import step_budgets
from hyperqwen.capacity_probe import probe_machine
from hyperqwen.engine.features import FEATURES
from hyperqwen.exit_codes import EXIT_BAD_INPUT
from hyperqwen.gpu import NoGpu, list_gpus
from hyperqwen.kv_choices import KV_CACHE_DTYPES, KVARN_CHOICE, speculation_refusal
from hyperqwen.launch import (
    BATCH_PROFILE,
    SINGLE_PROFILES,
    build_launch,
    cache_setup,
    model_path,
    profile_for,
)
from hyperqwen.settings import MODES, LoadedSettings, SettingsError, StateDtype, load_settings
from hyperqwen.vllm_flags import flag_value

SLOT_COUNTS = (1, 2, 4)
# Request lengths (prompt + answer) the batch table sizes: 640 is the batch benchmark's 128 in +
# 512 out (bench/README.md), the others a long chat and a long document.
BATCH_REQUEST_TOKENS = (640, 8192, 32768)
BATCH_CONCURRENCY = (64, 256)


def capacity_table(
    machine: Machine,
    setup: CacheSetup,
    gpu_util: float,
    batched: int,
    profile_tokens: int,
    spec: str,
) -> str:
    """A markdown table: per KV choice, the pool's block, the longest request at 1, 2, 4 slots
    and whether it serves with this SPEC (single mode refuses TurboQuant with speculation)."""
    pool, how = card_pool_bytes(machine, gpu_util, batched, setup.tensor_parallel)
    head = "| KV | block (tokens) | " + " | ".join(f"max len at {n}" for n in SLOT_COUNTS)
    lines = [
        f"{how}, at {batched:,} tokens a step: {pool / GiB:.2f} GiB for KV cache and recurrent "
        f"state ({state_terms(setup)}, {setup.ssm_dtype} state).",
        "",
        f"{head} | serves with SPEC={spec} |",
        "|---|---:|" + "---:|" * len(SLOT_COUNTS) + "---|",
    ]
    for kv in KV_CACHE_DTYPES:
        capacity = Capacity(pool_layout(machine.geometry, replace(setup, kv_cache_dtype=kv)), pool)
        lengths = " | ".join(f"{capacity.max_len(n):,}" for n in SLOT_COUNTS)
        serves = "no: refused" if speculation_refusal(kv, spec) else "yes"
        lines.append(f"| {kv} | {capacity.layout.block_tokens:,} | {lengths} | {serves} |")
    kvarn = kvarn_row(machine, setup, gpu_util, batched, profile_tokens, spec)
    return "\n".join([*lines, *kvarn])


def kvarn_row(
    machine: Machine,
    setup: CacheSetup,
    gpu_util: float,
    batched: int,
    profile_tokens: int,
    spec: str,
) -> list[str]:
    """KV=kvarn's row and its footnote: its pool at the tokens a step it serves with (its
    blocks are whole 128-token tiles, and the launcher's step budgets never go below one
    block: capacity_fit.step_budgets), less its 16-bit side cache, which grows with the
    slots, and its prefill scratch."""
    kvarn = replace(setup, kv_cache_dtype=KVARN_CHOICE)
    layout = pool_layout(machine.geometry, kvarn)
    step = max(batched, step_budgets(profile_tokens, layout.block_tokens)[-1])
    pool, _ = card_pool_bytes(machine, gpu_util, step, setup.tensor_parallel)
    lengths = []
    for slots in SLOT_COUNTS:
        side = kvarn_side_bytes(machine.geometry, kvarn, slots, step)
        lengths.append(f"{Capacity(layout, pool - side).max_len(slots):,}")
    refusal = speculation_refusal(KVARN_CHOICE, spec, setup.draft_tokens or None)
    serves = "no: refused" if refusal else "yes"
    return [
        f"| {KVARN_CHOICE} | {layout.block_tokens:,} | {' | '.join(lengths)} | {serves} |",
        "",
        f"{KVARN_CHOICE}: HyperQwen's 4-bit K / {kvarn.v_bits}-bit V cache "
        f"(src/hyperqwen/kvarn), at {step:,} tokens a step, less its 16-bit side cache for that "
        "many slots and its prefill scratch.",
    ]


def residency_table(machine: Machine, setup: CacheSetup, gpu_util: float, batched: int) -> str:
    """A markdown table: per GDN state dtype, the pool one request's state takes and how many
    requests of each BATCH_REQUEST_TOKENS length the pool holds at once (beyond that, vLLM
    queues or preempts them)."""
    pool, how = card_pool_bytes(machine, gpu_util, batched, setup.tensor_parallel)
    lengths = " | ".join(f"resident at {n:,} tokens" for n in BATCH_REQUEST_TOKENS)
    lines = [
        f"{how}, at {batched:,} tokens a step: {pool / GiB:.2f} GiB for KV cache "
        f"({setup.kv_name}) and recurrent state (prefix caching "
        f"{'on' if setup.prefix_caching else 'off'}). A run at "
        + " or ".join(f"C{c}" for c in BATCH_CONCURRENCY)
        + " keeps every request resident only where the count is at least C (and MAX_SEQS "
        "is at least C); the rest wait or are preempted.",
        "",
        f"| state dtype | state per request (MiB) | {lengths} |",
        "|---|---:|" + "---:|" * len(BATCH_REQUEST_TOKENS),
    ]
    for dtype in get_args(StateDtype):
        capacity = Capacity(pool_layout(machine.geometry, replace(setup, ssm_dtype=dtype)), pool)
        state = capacity.layout.state_bytes_per_request / MiB
        counts = " | ".join(f"{capacity.slots(n):,}" for n in BATCH_REQUEST_TOKENS)
        mark = " (this setup)" if dtype == setup.ssm_dtype else ""
        lines.append(f"| {dtype}{mark} | {state:.1f} | {counts} |")
    return "\n".join(lines)


def cmd_capacity(args: argparse.Namespace) -> int:
    try:
        loaded = load_settings(env_file=Path(args.env_file) if args.env_file else None)
    except SettingsError as error:
        print(f"hyperqwen capacity: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    settings = loaded.settings
    gpus = []
    if args.card_gib is None:
        with contextlib.suppress(NoGpu):  # none: probe_machine assumes a 24 GiB card, says so
            gpus = list_gpus()
    machine = probe_machine(settings, model_path(settings), gpus)
    if isinstance(machine, str):
        print(f"hyperqwen capacity: {machine}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.card_gib is not None:
        card = f"a {args.card_gib:g} GiB card"
        machine = Machine(int(args.card_gib * GiB), card, machine.geometry,
                          machine.weight_bytes, machine.weight_source)  # fmt: skip
    batched, serve_line = serve_sizing(loaded, args.mode, machine)
    if args.mode == "batch":
        setup = cache_setup(settings, BATCH_PROFILE, machine, mode="batch")
        print(residency_table(machine, setup, settings.GPU_UTIL, batched))
    else:
        setup = cache_setup(settings, SINGLE_PROFILES[settings.CTX], machine)
        profile_tokens = SINGLE_PROFILES[settings.CTX].max_batched_tokens
        print(
            capacity_table(
                machine, setup, settings.GPU_UTIL, batched, profile_tokens, settings.SPEC
            )
        )
    print(f"\n{serve_line}")
    return 0


def serve_sizing(loaded: LoadedSettings, mode: str, machine: Machine) -> tuple[int, str]:
    """The tokens per step `hyperqwen serve MODE` takes on this card (the tables are sized at
    it) and its startup line, or its refusal."""
    profile = profile_for(loaded.settings, mode)
    try:
        plan = build_launch(loaded, mode, api_key=None, machine=machine)
    except SettingsError as refusal:  # a knob the card cannot hold, or a refused combination
        return profile.max_batched_tokens, f"hyperqwen serve {mode} would refuse: {refusal}"
    # what vLLM will run with: EXTRA_ARGS may set --max-num-batched-tokens after the launcher
    batched = int(flag_value(plan.argv, "--max-num-batched-tokens") or profile.max_batched_tokens)
    return batched, f"hyperqwen serve {mode} starts with: {plan.fit.line}"


def add_subcommand(sub) -> None:
    # the engine features that change how much GDN state a request keeps (their knobs)
    state_features = [feature for feature in FEATURES if feature.one_gdn_state_per_request]
    state_knobs = ", ".join(feature.knob for feature in state_features)
    state_knobs_on = " ".join(f"{feature.knob}=1" for feature in state_features)
    # the knob of KVarN's value bits, which its row sizes with
    bits_knobs = "".join(f"{f.knob} (kvarn's row), " for f in FEATURES if f.kvarn_value_bits)
    parser = sub.add_parser(
        "capacity",
        help="how many tokens of context this card holds per KV-cache dtype (single mode), "
        "or how many requests stay resident per state dtype (--mode batch)",
        description=(__doc__ or "").split("\n\n", 1)[-1],
        epilog=f"The model, SPEC, DRAFT_TOKENS, {state_knobs}, PREFIX_CACHE, GPU_UTIL, KV, "
        f"{bits_knobs}STATE_DTYPE and CTX (its prefill batch) come from the environment or .env, "
        "as for `hyperqwen serve`.\nExamples: hyperqwen capacity --card-gib 24; hyperqwen capacity "
        f"--mode batch --card-gib 140; DRAFT_TOKENS=15 {state_knobs_on} hyperqwen capacity "
        "--card-gib 24",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--card-gib",
        type=_positive,
        help="size for a card of this many GiB (nvidia-smi's memory.total) instead of this "
        "machine's GPU",
    )
    parser.add_argument(
        "--mode", choices=MODES, default="single", help="the profile to size (default single)"
    )
    parser.add_argument("--env-file", metavar="FILE", help="knobs (default ./.env)")
    parser.set_defaults(func=cmd_capacity)


def _positive(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text}: must be a positive number of GiB")
    return value

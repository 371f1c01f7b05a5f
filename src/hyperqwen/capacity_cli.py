"""`hyperqwen capacity`: how much context a card holds, per KV-cache dtype, before serving.

The same arithmetic `hyperqwen serve` sizes CTX=long and huge with (capacity.py): the card's
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

from hyperqwen.capacity import (
    CacheSetup,
    Capacity,
    GiB,
    Machine,
    card_pool_bytes,
    pool_layout,
)
from hyperqwen.capacity_probe import probe_machine
from hyperqwen.gpu import NoGpu, list_gpus
from hyperqwen.kv_choices import KV_CACHE_DTYPES, speculation_refusal
from hyperqwen.launch import SINGLE_PROFILES, cache_setup, model_path
from hyperqwen.settings import SettingsError, load_settings

EXIT_BAD_INPUT = 2
SLOT_COUNTS = (1, 2, 4)


def capacity_table(
    machine: Machine, setup: CacheSetup, gpu_util: float, batched: int, spec: str
) -> str:
    """A markdown table: per KV choice, the pool's block, the longest request at 1, 2, 4 slots
    and whether it serves with this SPEC (single mode refuses TurboQuant with speculation)."""
    pool, how = card_pool_bytes(machine, gpu_util, batched, setup.tensor_parallel)
    head = "| KV | block (tokens) | " + " | ".join(f"max len at {n}" for n in SLOT_COUNTS)
    lines = [
        f"{how}: {pool / GiB:.2f} GiB for KV cache and recurrent state "
        f"({setup.draft_tokens} draft tokens, prefix caching "
        f"{'on' if setup.prefix_caching else 'off'}, {setup.ssm_dtype} state).",
        "",
        f"{head} | serves with SPEC={spec} |",
        "|---|---:|" + "---:|" * len(SLOT_COUNTS) + "---|",
    ]
    for kv in KV_CACHE_DTYPES:
        capacity = Capacity(pool_layout(machine.geometry, replace(setup, kv_cache_dtype=kv)), pool)
        lengths = " | ".join(f"{capacity.max_len(n):,}" for n in SLOT_COUNTS)
        serves = "no: refused" if speculation_refusal(kv, spec) else "yes"
        lines.append(f"| {kv} | {capacity.layout.block_tokens:,} | {lengths} | {serves} |")
    return "\n".join(lines)


def cmd_capacity(args: argparse.Namespace) -> int:
    try:
        settings = load_settings(env_file=Path(args.env_file) if args.env_file else None).settings
    except SettingsError as error:
        print(f"hyperqwen capacity: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
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
    profile = SINGLE_PROFILES[settings.CTX]
    setup = cache_setup(settings, profile, machine)
    batched = profile.max_batched_tokens
    print(capacity_table(machine, setup, settings.GPU_UTIL, batched, settings.SPEC))
    return 0


def add_subcommand(sub) -> None:
    parser = sub.add_parser(
        "capacity",
        help="how many tokens of context this card holds per KV-cache dtype (single mode)",
        description=(__doc__ or "").split("\n\n", 1)[-1],
        epilog="The model, SPEC, DRAFT_TOKENS, PREFIX_CACHE, GPU_UTIL and CTX (its prefill "
        "batch) come from the environment or .env, as for `hyperqwen serve single`.\n"
        "Example: hyperqwen capacity --card-gib 24",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--card-gib",
        type=_positive,
        help="size for a card of this many GiB (nvidia-smi's memory.total) instead of this "
        "machine's GPU",
    )
    parser.add_argument("--env-file", metavar="FILE", help="knobs (default ./.env)")
    parser.set_defaults(func=cmd_capacity)


def _positive(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text}: must be a positive number of GiB")
    return value

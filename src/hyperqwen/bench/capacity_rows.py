"""`hyperqwen bench capacity`: how many tokens of context fit a 24 GiB memory budget, per KV
choice, with MTP on (issue 25: 262,144 tokens at one slot; moonshot: two slots). GPU host.

For each KV choice (kv_choices.py) that serves with SPEC=mtp, the prepared 27B geometry
(`hyperqwen synth --preset 27b --config-only --prepared --draft-head`, dummy weights) starts
through `hyperqwen serve single` with CTX=huge and MAX_SEQS=1, GPU_UTIL scaled so vLLM requests
the budget of this (larger) card: weights + peak activation + non-torch memory + CUDA graphs +
KV cache and GDN state = the budget (vLLM 0.26 counts its CUDA-graph estimate in). The server
stops once vLLM has logged its CUDA-graph memory (after "GPU KV cache size"). A side whose
length vLLM refuses is served once more at the longest length vLLM names. A choice that
cannot serve with MTP becomes a refused row, the reason kv_choices gives.

Stock (--stock-vllm): that vLLM 0.26 serves the unprepared base (`synth --preset 27b
--config-only`) at the same budget, max_model_len, one slot, KV dtype (and the backend it
needs), MTP drafts and prefix caching, everything else its defaults. KVarN has no stock
counterpart: its stock side is null.

Writes one result file in `bench ab`'s row schema: capacity_<kv> (tokens: vLLM's "GPU KV cache
size"), and per choice the parts vLLM logged (GiB): _weights, _activation_peak, _non_torch,
_cuda_graphs, _kv_pool; _concurrency (requests of max_len the pool holds), _max_len (tokens:
the max_model_len that side served at, the launcher's fit or vLLM's longest), and
_state_computed (the GDN state one slot takes, from capacity.py's layout, not logged).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from hyperqwen.bench.capacity_serve import (
    TOO_LONG_LINE,
    USAGE_LINE,
    VllmSizing,
    gpu_util_for_budget,
    package_env,
    parse_sizing,
    served_until_logged,
    synth_command,
)
from hyperqwen.bench.results import RESULT_SCHEMA, ComparisonRow, comparison_row
from hyperqwen.bench.server_process import SERVER_HOST, free_port
from hyperqwen.capacity import (
    ASSUMED_CARD_BYTES,
    PREPARED_27B_WEIGHT_BYTES,
    GiB,
    Machine,
    pool_layout,
)
from hyperqwen.checkpoint.geometry import PRESETS
from hyperqwen.gpu import Gpu
from hyperqwen.kv_choices import KV_CHOICES, KVARN_CHOICE, capability_refusal, speculation_refusal
from hyperqwen.launch import SINGLE_PROFILES, cache_setup, speculative_config
from hyperqwen.settings import Settings, SettingsError, load_settings

SPEC = "mtp"
CTX = "huge"
TARGET_TOKENS = 262144
BUDGET_GIB = 24.0
PATCHED_MODEL, STOCK_MODEL = "q27p", "q27"
# Both sides as the GPU tests and `bench ab` serve dummy weights: GDN prefill through Triton.
DEFAULT_VLLM_ARGS = """--load-format dummy --additional-config '{"gdn_prefill_backend":"triton"}'"""
# A cold 27B-geometry start with torch.compile and CUDA graphs takes ~4 min (tests/gpu_server.py).
DEFAULT_TIMEOUT_S = 900
SYNTH_TIMEOUT_S = 300
# The vLLM parts each choice publishes: (row suffix, VllmSizing field), GiB
STOCK_NOTE = (
    "stock = stock vLLM 0.26 serving the unprepared base at the patched side's budget, "
    "max_model_len, one slot, KV dtype (and the backend it needs), MTP drafts and prefix "
    "caching, everything else its defaults; null where not run, none for KVarN (HyperQwen's "
    "own cache). _state_computed: capacity.py's layout, the same on both sides, not logged."
)
PART_ROWS = (
    ("weights", "weight_gib"),
    ("activation_peak", "activation_gib"),
    ("non_torch", "non_torch_gib"),
    ("cuda_graphs", "graph_gib"),
    ("kv_pool", "pool_gib"),
)


class CapacityRunError(Exception):
    """A server did not log its sizing; the message names the knob or flag and the log."""


class TooLongError(CapacityRunError):
    """vLLM refused max_model_len: its pool holds at most `longest` tokens for one request."""

    def __init__(self, message: str, longest: int):
        super().__init__(message)
        self.longest = longest


@dataclass(frozen=True)
class ChoicePlan:
    kv: str
    refusal: str | None  # why it cannot serve with MTP here (kv_choices), or None
    has_stock: bool  # stock vLLM serves this dtype: every one but HyperQwen's KVarN


def plan_choices(kvs: list[str], gpus: list[Gpu]) -> list[ChoicePlan]:
    return [
        ChoicePlan(
            kv, speculation_refusal(kv, SPEC) or capability_refusal(kv, gpus), kv != KVARN_CHOICE
        )
        for kv in kvs
    ]


def patched_knobs(
    kv: str, models: Path, gpu_util: float, port: int, vllm_args: str, max_len: int | None = None
) -> dict:
    """`hyperqwen serve single`'s knobs: the launcher sizes MAX_LEN for one slot from GPU_UTIL
    unless max_len is given."""
    return {
        **({"MAX_LEN": str(max_len)} if max_len else {}),
        "MODELS_DIR": str(models),
        "MODEL": PATCHED_MODEL,
        "CTX": CTX,
        "MAX_SEQS": "1",
        "KV": kv,
        "SPEC": SPEC,
        "GPU_UTIL": f"{gpu_util}",
        "HOST": SERVER_HOST,
        "PORT": str(port),
        "TOOLS": "0",
        "EXTRA_ARGS": vllm_args,
    }


def patched_settings(knobs: dict[str, str], work: Path) -> Settings:
    """The knobs as the launcher reads them (no .env: only these count)."""
    return load_settings(knobs, env_file=work / "no.env").settings


def stock_argv(settings: Settings, model: Path, max_len: int, port: int) -> list[str]:
    """Stock `vllm serve` (the vllm/ first on PYTHONPATH, vllm_first) with the patched side's
    budget, length, slot, KV dtype, MTP drafts and prefix caching; the rest vLLM's defaults.
    No HyperQwen keys in the speculative config."""
    choice = KV_CHOICES[settings.KV]
    spec = speculative_config(settings)
    drafts = {"method": spec["method"], "num_speculative_tokens": spec["num_speculative_tokens"]}
    argv = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model)]
    argv += ["--host", SERVER_HOST, "--port", str(port)]
    argv += ["--served-model-name", model.name, "--language-model-only"]
    argv += ["--gpu-memory-utilization", f"{settings.GPU_UTIL}", "--max-model-len", str(max_len)]
    argv += ["--max-num-seqs", str(settings.MAX_SEQS), "--enable-prefix-caching"]
    argv += ["--kv-cache-dtype", choice.vllm_cache_dtype]
    argv += [part for flag in choice.launch_flags() for part in flag]
    argv += ["--speculative-config", json.dumps(drafts)]
    return argv + shlex.split(settings.EXTRA_ARGS)


def state_gib_per_slot(settings: Settings) -> float:
    """The GDN state one slot holds in the pool, padded to blocks, as the launcher lays the
    pool out for these knobs (capacity.py): MTP's drafts and prefix caching's block included."""
    machine = Machine(
        ASSUMED_CARD_BYTES,
        "a 24 GiB card",
        PRESETS["27b"],
        PREPARED_27B_WEIGHT_BYTES,
        "the prepared 27B",
    )
    setup = cache_setup(settings, SINGLE_PROFILES[CTX], machine)
    return round(pool_layout(machine.geometry, setup).state_bytes_per_request / GiB, 2)


def choice_rows(
    kv: str, patched: VllmSizing | None, stock: VllmSizing | None, state_gib: float | None
) -> list[ComparisonRow]:
    """One choice's rows; a side that did not run (or was refused) is null."""

    def field(side: VllmSizing | None, name: str):
        return None if side is None else getattr(side, name)

    rows = [
        comparison_row(
            f"capacity_{kv}", "tokens", field(stock, "cache_tokens"), field(patched, "cache_tokens")
        )
    ]
    if patched is None and stock is None:
        return rows
    for suffix, name in PART_ROWS:
        rows.append(
            comparison_row(
                f"capacity_{kv}_{suffix}", "GiB", field(stock, name), field(patched, name)
            )
        )
    rows.append(
        comparison_row(
            f"capacity_{kv}_concurrency",
            "x",
            field(stock, "concurrency"),
            field(patched, "concurrency"),
        )
    )
    rows.append(
        comparison_row(
            f"capacity_{kv}_max_len", "tokens", field(stock, "max_len"), field(patched, "max_len")
        )
    )
    stock_state = state_gib if stock is not None else None
    rows.append(comparison_row(f"capacity_{kv}_state_computed", "GiB", stock_state, state_gib))
    return rows


def vllm_first(parent: Path | None, env: dict[str, str]) -> dict[str, str]:
    """env with parent's vllm/ (--stock-vllm, --patched-vllm) first on PYTHONPATH, before this
    checkout's package (package_env); env as is without a parent."""
    if parent is None:
        return env
    return {**env, "PYTHONPATH": f"{parent}{os.pathsep}{package_env()['PYTHONPATH']}"}


def serve_and_read(command: list[str], env: dict, log: Path, timeout_s: float, side: str):
    """Serve until vLLM logs its CUDA-graph memory; its sizing, or CapacityRunError."""
    sizing = parse_sizing(served_until_logged(command, env, log, USAGE_LINE, timeout_s))
    if sizing.complete:
        return sizing
    text = log.read_text(errors="replace")
    if too_long := TOO_LONG_LINE.search(text):
        raise TooLongError(
            f"{side}: vLLM refused max_model_len {too_long[1]}: the pool it found holds at most "
            f"{int(too_long[2]):,} tokens (the launcher's reserve estimate, capacity.py, was too "
            f"small); rerun with --max-len {too_long[2]} or less; log {log}",
            int(too_long[2]),
        )
    raise CapacityRunError(
        f"{side}: vLLM did not log its KV cache size and CUDA-graph memory within "
        f"--timeout-s {timeout_s:g} (exited or refused first?); log {log}:\n{text[-1500:]}"
    )


def sized_side(at, max_len, log_stem: Path, timeout_s: float, side: str, notes: list[str]):
    """One side's sizing, served by at(max_len) -> (command, env). Where vLLM refuses the
    length (the launcher's estimate was too generous), serve once more at the longest vLLM
    says fits, so the row holds vLLM's own figures; None (the error in notes) where it fails."""
    for attempt in range(2):
        command, env = at(max_len)
        log = log_stem.with_name(f"{log_stem.name}{'-refit' if attempt else ''}.log")
        try:
            sizing = serve_and_read(command, env, log, timeout_s, side)
        except TooLongError as error:
            notes.append(str(error))
            progress(str(error))
            if attempt:
                return None
            max_len = error.longest
            notes.append(f"{side}: served again at vLLM's longest, max_model_len {max_len}")
            progress(notes[-1])
            continue
        except CapacityRunError as error:
            notes.append(str(error).split("\n")[0])
            progress(str(error))
            return None
        progress(
            f"{side}: {sizing.cache_tokens:,} tokens, {sizing.concurrency}x at "
            f"max_model_len {sizing.max_len:,}"
        )
        return sizing


def step_note(kv: str, patched: VllmSizing | None, stock: VllmSizing | None) -> str:
    """The tokens per step each side served at: vLLM's profile run reserves activations for a
    whole step, so the pool depends on it (the launcher halves it where the profile does not
    fit: capacity_fit.py)."""

    def steps(side: VllmSizing | None) -> str:
        if side is None:
            return "not served"
        return f"{side.step_tokens:,}" if side.step_tokens else "vLLM's default"

    return (
        f"capacity_{kv}: tokens per step (--max-num-batched-tokens): patched {steps(patched)}, "
        f"stock {steps(stock)}"
    )


def shared_gpu_notes(kv: str, side: str, sizing: VllmSizing | None) -> list[str]:
    """A note where vLLM's own accounting shows that another process used the GPU while it
    profiled: its pool, read off the whole card, is then not this configuration's."""
    if sizing is None or sizing.non_torch_gib is None or sizing.non_torch_gib >= 0:
        return []
    return [
        f"capacity_{kv} ({side}): vLLM logged {sizing.non_torch_gib:g} GiB of non-torch memory, "
        "below zero: another process freed GPU memory during its profiling run, so the pool "
        "it found is not this configuration's; rerun on an otherwise idle GPU"
    ]


def progress(message: str) -> None:
    print(f"bench capacity: {message}", flush=True)


def synthesize(work: Path) -> Path:
    models = work / "models"
    for name, prepared in ((PATCHED_MODEL, True), (STOCK_MODEL, False)):
        if not (models / name / "config.json").exists():
            progress(f"synthesizing {models / name} (27b config, prepared={prepared})")
            command = synth_command(models / name, prepared)
            done = subprocess.run(
                command, env=package_env(), timeout=SYNTH_TIMEOUT_S, capture_output=True, text=True
            )
            if done.returncode:
                raise CapacityRunError(f"`{shlex.join(command)}` failed:\n{done.stderr[-1500:]}")
    return models


def run_choice(plan: ChoicePlan, args, models: Path, util: float) -> tuple[list, list[str]]:
    """Rows and notes of one KV choice; a failed side is null with its error in the notes."""
    kv, notes = plan.kv, []
    if plan.refusal:
        progress(f"KV={kv}: refused with SPEC={SPEC}: {plan.refusal}")
        return choice_rows(kv, None, None, None), [f"capacity_{kv}: refused: {plan.refusal}"]
    logs = args.work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    settings = patched_settings(
        patched_knobs(kv, models, util, free_port(), args.vllm_args, args.max_len), args.work
    )
    command = [sys.executable, "-m", "hyperqwen.cli", "serve", "single"]

    def patched_at(max_len: int | None):
        knobs = patched_knobs(kv, models, util, free_port(), args.vllm_args, max_len)
        return command, vllm_first(args.patched_vllm, knobs)

    progress(f"KV={kv}: patched `hyperqwen serve single` (GPU_UTIL {util}) ...")
    patched = sized_side(
        patched_at, args.max_len, logs / f"{kv}-patched", args.timeout_s, f"KV={kv} patched", notes
    )
    stock = None
    if args.stock_vllm and plan.has_stock and patched is not None:
        model, stock_env = models / STOCK_MODEL, vllm_first(args.stock_vllm, {})

        def stock_at(max_len: int | None):
            return stock_argv(settings, model, max_len or patched.max_len, free_port()), stock_env

        progress(f"KV={kv}: stock vLLM from {args.stock_vllm} ...")
        side = f"KV={kv} stock (--stock-vllm)"
        stock = sized_side(stock_at, None, logs / f"{kv}-stock", args.timeout_s, side, notes)
    elif not plan.has_stock:
        notes.append(f"capacity_{kv}: no stock counterpart (HyperQwen's own cache)")
    for note in shared_gpu_notes(kv, "patched", patched) + shared_gpu_notes(kv, "stock", stock):
        progress(note)
        notes.append(note)
    notes.append(step_note(kv, patched, stock))
    state = state_gib_per_slot(settings)
    return choice_rows(kv, patched, stock, state), notes


def result_document(args, gpu: Gpu, util: float, rows, notes: list[str]) -> dict:
    from hyperqwen.bench.header import git_commit

    stock = f"stock = {args.stock_vllm}" if args.stock_vllm else "stock not run (--stock-vllm)"
    return {
        "schema": RESULT_SCHEMA,
        "gpu": f"{gpu.name} ({gpu.sm}), pinned to {args.budget_gib:g} GiB (GPU_UTIL {util})",
        "vllm": f"patched vLLM 0.26.0 through `hyperqwen serve single`; {stock}",
        "commit": args.commit or git_commit(),
        "date": args.started,
        "command": shlex.join(["hyperqwen", "bench", "capacity", *sys.argv[3:]]),
        "model": f"{PATCHED_MODEL} (27b geometry, prepared, draft head) with dummy weights; "
        f"stock: {STOCK_MODEL} (unprepared base)",
        "notes": [
            f"patched = tokens vLLM logs ('GPU KV cache size') at CTX={CTX}, MAX_SEQS=1, "
            f"SPEC={SPEC}, prefix caching on; target {TARGET_TOKENS:,} at one slot, moonshot "
            f"concurrency 2 at {TARGET_TOKENS:,}. The budget is vLLM's requested memory: "
            "weights + peak activation + non-torch + CUDA graphs + KV pool (GDN state in it).",
            STOCK_NOTE,
            *notes,
        ],
        "rows": [asdict(row) for row in rows],
    }


def cmd_capacity(args: argparse.Namespace) -> int:
    from hyperqwen.gpu import NoGpu, list_gpus

    try:
        gpu = list_gpus()[0]
    except NoGpu as error:
        print(f"bench capacity: needs a CUDA GPU: {error}", file=sys.stderr)
        return 3
    budget = args.budget_gib * GiB
    card = int(gpu.memory_gib * GiB)
    if budget > card:
        print(
            f"bench capacity: --budget-gib {args.budget_gib:g} exceeds this card "
            f"({gpu.name}, {gpu.memory_gib:.1f} GiB)",
            file=sys.stderr,
        )
        return 2
    util = gpu_util_for_budget(budget, card)
    args.work.mkdir(parents=True, exist_ok=True)
    args.started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    try:
        models = synthesize(args.work)
    except CapacityRunError as error:
        print(f"bench capacity: {error}", file=sys.stderr)
        return 1
    rows, notes, failed = [], [], False
    for plan in plan_choices(args.kv, [gpu]):
        try:
            choice, choice_notes = run_choice(plan, args, models, util)
        except SettingsError as error:  # a knob the launcher refuses: named in the message
            choice, choice_notes = choice_rows(plan.kv, None, None, None), [str(error)]
        failed |= not plan.refusal and choice[0].patched is None
        rows += choice
        notes += choice_notes
        # written after every choice, so a run cut short keeps what it measured
        args.out.write_text(json.dumps(result_document(args, gpu, util, rows, notes), indent=1))
    progress(f"wrote {args.out} (publish: hyperqwen bench publish {args.out} --name NAME)")
    return 1 if failed else 0


def _kv_list(text: str) -> list[str]:
    kvs = [kv for kv in text.split(",") if kv]
    unknown = [kv for kv in kvs if kv not in KV_CHOICES]
    if unknown or not kvs:
        raise argparse.ArgumentTypeError(
            f"{','.join(unknown) or text!r}: expected KV choices from {', '.join(KV_CHOICES)}"
        )
    return kvs


def add_subcommand(actions) -> None:
    parser = actions.add_parser(
        "capacity",
        help="tokens that fit a 24 GiB budget per KV choice, MTP on (GPU host, starts servers)",
        description=__doc__,
        epilog="Example: hyperqwen bench capacity --kv fp8,int4_per_token_head "
        "--stock-vllm /tmp/gpu-kit/vllm-stock --patched-vllm /tmp/gpu-kit/vllm-patched "
        "--out capacity.json\n"
        "Exit codes: 0 done, 1 a choice that serves with MTP did not size, 2 bad options, "
        "3 no GPU.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--kv",
        type=_kv_list,
        default=list(KV_CHOICES),
        metavar="LIST",
        help="KV choices, comma-separated (default: all, refused ones as refused rows)",
    )
    parser.add_argument(
        "--budget-gib",
        type=float,
        default=BUDGET_GIB,
        help="memory vLLM may take, GiB (default %(default)g: a 24 GB card)",
    )
    parser.add_argument(
        "--stock-vllm", metavar="PARENT_DIR", type=Path, help="folder holding a stock vllm/"
    )
    parser.add_argument(
        "--patched-vllm",
        metavar="PARENT_DIR",
        type=Path,
        help="folder holding the patched vllm/ (default: the one this Python imports)",
    )
    parser.add_argument(
        "--vllm-args",
        default=DEFAULT_VLLM_ARGS,
        help="vLLM flags both sides get (patched: EXTRA_ARGS; default %(default)s)",
    )
    parser.add_argument(
        "--max-len",
        type=int,
        help="MAX_LEN for the patched side (default: the launcher sizes it for the budget; set "
        "it when vLLM finds less room than the launcher estimated)",
    )
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help="per server, until vLLM logs its sizing (default %(default)g)",
    )
    parser.add_argument(
        "--work",
        type=Path,
        default=Path("capacity-work"),
        help="synthesized models and server logs (default %(default)s)",
    )
    parser.add_argument("--out", type=Path, default=Path("capacity-result.json"))
    parser.add_argument("--commit", help="the checkout's commit when it has no .git")
    parser.set_defaults(func=cmd_capacity)

"""Each side's `vllm serve` arguments and environment for `bench ab`, and the notes they imply.

The stock side: vLLM's defaults, the patched side's --speculative-config with --stock-spec same,
then --vllm-args and --stock-args. The patched side: the argv `hyperqwen serve MODE` would run,
then --vllm-args. Synthetic acceptance and the profiler go into both where they apply. Flags are
read with hyperqwen.vllm_flags, the launcher's reader, so every spelling vLLM takes counts.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import shlex
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from hyperqwen.bench.ab_plan import SIDES, ABError, ABPlan
from hyperqwen.bench.options import DEFAULT_COHORTS, _int_list
from hyperqwen.bench.profile import PROFILE_DELAY_STEPS, profiler_flags
from hyperqwen.bench.server_process import SERVER_HOST
from hyperqwen.capacity_probe import probe_machine
from hyperqwen.gpu import NoGpu, list_gpus
from hyperqwen.launch import LaunchPlan, build_launch
from hyperqwen.settings import LoadedSettings, SettingsError, knobs, load_settings
from hyperqwen.vllm_flags import (
    SPECULATIVE_CONFIG,
    flag_keys,
    flag_value,
    speculates,
    value_positions,
)

PREVIEW_PORT = 8000  # any valid port: the argv is only inspected, never run
MAX_NUM_SEQS = "--max-num-seqs"
KV_CACHE_MEMORY_FLAG = "--kv-cache-memory-bytes"  # vLLM's; the profile's KV_MEM sets it


def pins_kv_pool(command: Sequence[str]) -> bool:
    """Whether a server command fixes vLLM's KV-cache size. One that does not sizes it from
    the card's free memory after its profiling run, so a neighbour loading or capturing
    meanwhile counts as its own non-torch memory: its pool comes out wrong or below zero
    (bench/measurements/2026-12-04-h200-needle-start-together-unpinned.json)."""
    return any(arg.split("=")[0] == KV_CACHE_MEMORY_FLAG for arg in command)


def stock_serve_argv(model: Path, port: int) -> list[str]:
    """`vllm serve` of the model with vLLM's own defaults: only the address and model name."""
    address = ["--host", SERVER_HOST, "--port", str(port)]
    return ["serve", str(model), *address, "--served-model-name", model.name]


def _profile_overrides(model: Path, port: int) -> dict[str, str]:
    return {"MODEL": str(model), "PORT": str(port), "HOST": SERVER_HOST}


def _load_profile(
    model: Path, port: int, env_file: str | None, knob_values: dict[str, str] | None = None
) -> LoadedSettings:
    environ = {**os.environ, **(knob_values or {}), **_profile_overrides(model, port)}
    try:
        return load_settings(environ, Path(env_file) if env_file else None)
    except SettingsError as error:
        raise ABError(f"the project's profile cannot be built:\n{error}") from None


def profile_launch(
    model: Path,
    port: int,
    mode: str,
    env_file: str | None,
    knob_values: dict[str, str] | None = None,
    vllm_args: str = "",
) -> LaunchPlan:
    """What `hyperqwen serve MODE` would run for this model (knobs from env/.env, then
    `knob_values` over them), local: sized, as serve sizes it, to this machine's card (an
    assumed one without a GPU) and to a KV_MEM pool, with `vllm_args` (appended after the
    profile's argv) read as EXTRA_ARGS would be, so --load-format dummy counts the weights the
    config declares. A profile that cannot fit is refused here, naming the knob, rather than by
    vLLM after minutes of start-up."""
    loaded = _load_profile(model, port, env_file, knob_values)
    settings = loaded.settings
    extra = f"{settings.EXTRA_ARGS} {vllm_args}".strip()
    gpus = []
    with contextlib.suppress(NoGpu):  # none: probe_machine assumes a card and says so
        gpus = list_gpus()
    machine = probe_machine(settings.model_copy(update={"EXTRA_ARGS": extra}), model, gpus)
    try:
        return build_launch(loaded, mode, api_key=None, machine=machine)
    except SettingsError as refusal:
        raise ABError(f"the project's profile cannot serve {model}: {refusal}") from None


def profile_serve_argv(
    model: Path, port: int, mode: str, env_file: str | None, vllm_args: str = ""
) -> list[str]:
    launch = profile_launch(model, port, mode, env_file, vllm_args=vllm_args)
    return launch.argv[1:]  # drop "vllm"


def server_environment(parent: Path, launcher_env: dict[str, str] | None = None) -> dict:
    """A server's environment: this one's (less the key), with parent's vllm/ first on
    PYTHONPATH, and the launcher's variables where it runs the project's profile (the engine
    features' switches, engine/features.py, travel there as in `hyperqwen serve`)."""
    env = {key: value for key, value in os.environ.items() if key != "VLLM_API_KEY"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(parent), env.get("PYTHONPATH")]))
    return {**env, **(launcher_env or {})}


def side_environment(side: str, plan: ABPlan, port: int, parent: Path) -> dict:
    """One side's server environment; the patched side's carries the launcher's variables."""
    if side != "patched":
        return server_environment(parent)
    launch = profile_launch(
        Path(plan.model), port, plan.mode, plan.env_file, vllm_args=plan.vllm_args
    )
    return server_environment(parent, launch.env)


def environment_knobs(model: Path, env_file: str | None) -> dict[str, str]:
    """The profile's knobs set in the environment (not the ones bench ab sets, not secrets):
    the command that repeats a comparison must set them too."""
    loaded = _load_profile(model, PREVIEW_PORT, env_file)
    secret = {info.name for info in knobs() if info.secret}
    left_out = secret | _profile_overrides(model, PREVIEW_PORT).keys()
    return {
        name: os.environ[name]
        for name in sorted(loaded.explicit - left_out)
        if loaded.sources[name] == "environment"
    }


def server_command(template: str, side: str, argv: list[str], port: int) -> list[str]:
    """--server-command's template filled in: how one side's server starts."""
    text = template.format(
        python=shlex.quote(sys.executable), args=shlex.join(argv), port=port, side=side
    )
    return shlex.split(text)


# --- speculation -----------------------------------------------------------------------------


def compact(config: dict) -> str:
    """A --speculative-config value as vLLM's own help writes one: JSON without spaces."""
    return json.dumps(config, separators=(",", ":"))


def _refuse_spec_keys(argv: list[str]) -> None:
    """bench ab reads and rewrites --speculative-config as one JSON value; one key set alone
    (--speculative-config.method=..., which vLLM would make the whole config of) is refused."""
    if keyed := flag_keys(argv, SPECULATIVE_CONFIG):
        raise ABError(
            f"{keyed[0]}: give the speculative config as one JSON value, e.g. "
            """--speculative-config '{"method":"ngram","num_speculative_tokens":4}'"""
        )


def synthetic_spec(config: dict, rates: tuple[float, ...], rest: float | None = None) -> dict:
    """A --speculative-config with vLLM 0.26's synthetic rejection sampling at these rates.

    rejection_sample_method "synthetic" accepts drafts at the given per-position rates
    whatever the weights say, so dummy weights still measure speculative decoding. rest, where
    given, is the rate of each drafted position past the rates (a server with more draft slots
    than the other side, e.g. DRAFT_TOKENS=15 against MTP's 3). Rates vLLM would refuse (not
    one per draft, outside [0, 1], increasing) are refused here by name.
    """
    # Imported here: vLLM's config module is slow to import and only this check needs it.
    from vllm.config.speculative import SpeculativeConfig

    drafts = config.get("num_speculative_tokens")
    if rest is not None and isinstance(drafts, int) and drafts > len(rates):
        rates = (*rates, *[rest] * (drafts - len(rates)))
    try:
        SpeculativeConfig._resolve_synthetic_acceptance_rates(drafts, list(rates), None)
    except (ValueError, TypeError) as error:
        raise ABError(
            f"--synthetic-acceptance {','.join(map(str, rates))}: {error} (the server "
            f"drafts {drafts} tokens: give that many rates, each in [0, 1], non-increasing)"
        ) from None
    return {**config, "rejection_sample_method": "synthetic",
            "synthetic_acceptance_rates": list(rates)}  # fmt: skip


def with_synthetic_acceptance(
    argv: list[str], rates: tuple[float, ...], rest: float | None = None
) -> list[str]:
    """argv with synthetic rejection sampling (synthetic_spec) in every --speculative-config."""
    _refuse_spec_keys(argv)
    patched = list(argv)
    for index, prefix in value_positions(argv, SPECULATIVE_CONFIG):
        if index >= len(argv):
            raise ABError("--speculative-config at the end of the flags has no value")
        config = json.loads(argv[index][len(prefix) :])
        patched[index] = prefix + compact(synthetic_spec(config, rates, rest))
    return patched


def spec_config(argv: list[str]) -> dict | None:
    """The --speculative-config vLLM would use (the last one), or None without one ("null"
    too: vLLM reads it as none)."""
    _refuse_spec_keys(argv)
    value = flag_value(argv, SPECULATIVE_CONFIG)
    try:
        config = json.loads(value) if value is not None else None
    except json.JSONDecodeError as error:
        raise ABError(f"--speculative-config {value!r} is not JSON: {error}") from None
    if config is not None and not isinstance(config, dict):
        raise ABError(f"--speculative-config {value!r}: give a JSON object")
    return config


def spec_fields(parent: Path) -> frozenset[str]:
    """The fields of parent/vllm's SpeculativeConfig: the keys its --speculative-config takes
    (vLLM refuses others). Read from the source, as that tree is not the one imported here."""
    source = parent / "vllm" / "config" / "speculative.py"
    try:
        tree = ast.parse(source.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError) as error:
        raise ABError(
            f"--stock-vllm {parent}: cannot read {source} ({error}); give the folder that holds "
            "vLLM 0.26.0's vllm/"
        ) from None
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "SpeculativeConfig":
            return frozenset(
                item.target.id
                for item in node.body
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
            )
    raise ABError(f"--stock-vllm {parent}: {source} defines no SpeculativeConfig")


def stock_speculation(plan: ABPlan) -> list[str]:
    """The profile's --speculative-config for the stock side (--stock-spec same), less any key
    the stock tree's SpeculativeConfig lacks (the result's note names those). Empty where the
    profile does not speculate: a --speculative-config in --vllm-args reaches both sides."""
    model = Path(plan.model)
    profile = profile_serve_argv(model, PREVIEW_PORT, plan.mode, plan.env_file, plan.vllm_args)
    config = spec_config(profile)
    if config is None:
        return []
    if plan.stock_vllm:  # absent in --phase patched, which does not start the stock side
        accepted = spec_fields(Path(plan.stock_vllm))
        config = {key: value for key, value in config.items() if key.replace("-", "_") in accepted}
    return [SPECULATIVE_CONFIG, compact(config)]


# --- each side's argv ------------------------------------------------------------------------


def base_argv(side: str, plan: ABPlan, port: int) -> list[str]:
    """The `vllm serve ...` arguments of one side before synthetic acceptance."""
    model = Path(plan.model)
    if side == "patched":
        profile = profile_serve_argv(model, port, plan.mode, plan.env_file, plan.vllm_args)
        return profile + shlex.split(plan.vllm_args)
    spec = stock_speculation(plan) if plan.stock_spec == "same" else []
    vllm_args, stock_args = shlex.split(plan.vllm_args), shlex.split(plan.stock_args)
    stock_model = Path(plan.stock_model) if plan.stock_model else model
    argv = [*stock_serve_argv(stock_model, port), *spec, *vllm_args, *stock_args]
    return argv + profile_streams(plan, argv)


def profile_streams(plan: ABPlan, stock: list[str]) -> list[str]:
    """The profile's --max-num-seqs for a stock side with a fixed KV pool and none of its own.

    vLLM's default (1024 streams on an H200) wants a Mamba state block per stream out of the
    pool, more than a pool sized for the profile holds, and the server does not start
    ("exceeds available Mamba cache blocks"); the same streams are also the same job.
    """
    if not pins_kv_pool(stock) or flag_value(stock, MAX_NUM_SEQS) is not None:
        return []
    streams = flag_value(base_argv("patched", plan, PREVIEW_PORT), MAX_NUM_SEQS)
    return [MAX_NUM_SEQS, streams] if streams is not None else []


def streams_note(stock_args: str, commands: dict[str, list[str]]) -> list[str]:
    """A line when the stock side serves the profile's --max-num-seqs (profile_streams)."""
    streams = flag_value(commands["stock"], MAX_NUM_SEQS)
    if streams is None or flag_value(shlex.split(stock_args), MAX_NUM_SEQS) is not None:
        return []
    return [
        f"The stock side serves the profile's {streams} streams (--max-num-seqs {streams}): "
        "with its KV pool fixed, vLLM's default stream count would not start."
    ]


def preview_commands(plan: ABPlan) -> dict[str, list[str]]:
    """Each side's `vllm serve ...` arguments, for checks before any server starts."""
    return {side: base_argv(side, plan, PREVIEW_PORT) for side in SIDES}


def trace_dir(plan: ABPlan, side: str) -> Path:
    return plan.workdir / f"{side}-trace"


def serve_argv(side: str, plan: ABPlan, port: int) -> list[str]:
    argv = base_argv(side, plan, port)
    if plan.synthetic_acceptance and speculates(argv):
        argv = with_synthetic_acceptance(
            argv, plan.synthetic_acceptance, plan.synthetic_acceptance_rest
        )
    if plan.profile_steps:
        argv += profiler_flags(trace_dir(plan, side), plan.profile_steps, PROFILE_DELAY_STEPS)
    return argv


# --- settling defaults and checking before any server starts ---------------------------------


def settled_stock_spec(plan: ABPlan) -> ABPlan:
    """--stock-spec's default: same where the patched side speculates, else none."""
    patched_speculates = speculates(base_argv("patched", plan, PREVIEW_PORT))
    if plan.stock_spec is None:
        return replace(plan, stock_spec="same" if patched_speculates else "none")
    if plan.stock_spec == "same" and not patched_speculates:
        raise ABError(
            "--stock-spec same: the patched side does not speculate (--mode batch never does, "
            "--mode single not with SPEC=off), so it has no --speculative-config to copy. Leave "
            "--stock-spec out (or give none), or pass --speculative-config in --vllm-args to "
            "speculate on both sides"
        )
    return plan


def check_synthetic_acceptance(plan: ABPlan) -> None:
    """Synthetic rates need a side that speculates; say so before any server starts."""
    if plan.synthetic_acceptance_rest is not None and not plan.synthetic_acceptance:
        raise ABError(
            "--synthetic-acceptance-rest is the rate past --synthetic-acceptance's rates: give "
            "--synthetic-acceptance too"
        )
    if not plan.synthetic_acceptance:
        return
    sides = [side for side, argv in preview_commands(plan).items() if speculates(argv)]
    if not sides:
        raise ABError(
            "--synthetic-acceptance needs speculative decoding on at least one side: use "
            "--mode single (SPEC=mtp or ngram) or pass --speculative-config in --vllm-args"
        )
    if len(sides) == 1:
        print(f"note: only the {sides[0]} side speculates; the rates apply to it", flush=True)


def max_num_seqs(commands: dict[str, list[str]]) -> dict[str, int]:
    """Each side's --max-num-seqs, where its command sets one (stock runs vLLM's default)."""
    values = {side: flag_value(command, MAX_NUM_SEQS) for side, command in commands.items()}
    return {side: int(value) for side, value in values.items() if value is not None}


def queue_notes(cohorts: Sequence[int], commands: dict[str, list[str]]) -> list[str]:
    """One line per side whose --max-num-seqs is below a cohort: those rows time a queue."""
    notes = []
    for side, limit in max_num_seqs(commands).items():
        if beyond := [c for c in cohorts if c > limit]:
            notes.append(
                f"The {side} side serves at most {limit} streams (--max-num-seqs {limit}): at "
                f"C{', C'.join(map(str, beyond))} the other streams wait for a slot, so those "
                "rows' TTFT and total tok/s include the queue."
            )
    return notes


def settled_cohorts(plan: ABPlan) -> ABPlan:
    """Default cohorts stay within each side's --max-num-seqs; given ones beyond it are warned of.

    A stream beyond the limit waits for a free slot: its TTFT becomes the queue. That is worth
    measuring on purpose (what the single profile does when 64 clients arrive), but not by
    default; the result notes say which rows it concerns (queue_notes).
    """
    commands = preview_commands(plan)
    if plan.cohorts is None:
        limit = min(max_num_seqs(commands).values(), default=None)
        default = _int_list(DEFAULT_COHORTS[plan.mode])
        return replace(plan, cohorts=tuple(c for c in default if limit is None or c <= limit))
    for note in queue_notes(plan.cohorts, commands):
        print(
            f"note: {note} Set MAX_SEQS (env file) or --max-num-seqs in --vllm-args to "
            "measure without the queue.",
            flush=True,
        )
    return plan


def baseline_note(commands: dict[str, list[str]]) -> str:
    """Which baseline the stock side was: its speculation against the patched side's."""
    stock, patched = spec_config(commands["stock"]), spec_config(commands["patched"])
    if stock is None and patched is None:
        return "Neither side speculates: the ratios compare the builds without speculation."
    if stock is None:
        return (
            "The stock side runs without speculation (--stock-spec none), the patched side "
            "speculates: these ratios include speculation's gain."
        )
    if patched is None:
        return f"The stock side speculates ({compact(stock)}), the patched side does not."
    if not stock.items() <= patched.items():
        return (
            f"The stock side speculates with its own --speculative-config ({compact(stock)}, "
            f"from --stock-args), the patched side with {compact(patched)}."
        )
    note = (
        "The stock side speculates with the patched side's --speculative-config (same method, "
        "drafts, acceptance): the ratios are against stock with the same speculation."
    )
    if left_out := [key for key in patched if key not in stock]:
        note += (
            f" Left out of the stock side's: {', '.join(left_out)} (stock vLLM's "
            "SpeculativeConfig has no such field)."
        )
    return note

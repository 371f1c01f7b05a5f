"""The `hyperqwen` command: serve, doctor, settings and the tools of the other folders."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

from hyperqwen import bench, capacity_cli, docs, doctor, synth
from hyperqwen.capacity_probe import probe_machine
from hyperqwen.drafter import cli as drafter_cli
from hyperqwen.gpu import REQUIREMENT, NoGpu, list_gpus
from hyperqwen.kv_choices import head_layout_refusal
from hyperqwen.launch import (
    build_launch,
    effective_config_lines,
    model_path,
    redact_argv,
    start_refusal,
)
from hyperqwen.parallel import tensor_parallel_refusal
from hyperqwen.patches import cli as patches_cli
from hyperqwen.prepare import cli as prepare_cli
from hyperqwen.settings import MODES, SettingsError, load_settings, resolve_api_key
from hyperqwen.toolkit import toolkit_env
from hyperqwen.vllm_plugin import unregistered_plugin_refusal

EXIT_BAD_SETTINGS = 2
EXIT_NO_GPU = 3
VLLM_CLI_MODULE = "vllm.entrypoints.cli.main"


def in_container(environ: dict[str, str]) -> bool:
    return environ.get("HYPERQWEN_IN_CONTAINER") == "1"


def _say(lines: list[str], prefix: str) -> None:
    for line in lines:
        print(f"{prefix}{line}", file=sys.stderr)


def cmd_serve(args: argparse.Namespace) -> int:
    environ = dict(os.environ)
    try:
        loaded = load_settings(environ, Path(args.env_file) if args.env_file else None)
    except SettingsError as error:
        print(f"hyperqwen serve {args.mode}: refusing to start:\n{error}", file=sys.stderr)
        return EXIT_BAD_SETTINGS
    api_key, _ = resolve_api_key(loaded.settings)
    try:
        gpus, no_gpu = list_gpus(), None
    except NoGpu as reason:
        gpus, no_gpu = [], reason
    kv = loaded.settings.KV
    refusal = start_refusal(loaded.settings, args.mode, gpus[: loaded.settings.GPU_COUNT])
    if refusal:
        print(f"hyperqwen serve {args.mode}: refusing to start: {refusal}", file=sys.stderr)
        return EXIT_BAD_SETTINGS
    machine = probe_machine(loaded.settings, model_path(loaded.settings), gpus)
    try:
        plan = build_launch(loaded, args.mode, api_key, in_container(environ), machine)
    except SettingsError as refusal:
        print(f"hyperqwen serve {args.mode}: refusing to start: {refusal}", file=sys.stderr)
        return EXIT_BAD_SETTINGS
    _say(plan.warnings, "WARNING: ")
    _say(plan.notices, "note: ")
    print_argv = args.print_argv or environ.get("PRINT_ARGV") == "1"
    if print_argv:
        print("\n".join(redact_argv(plan.argv)))
        return 0
    print(f"hyperqwen serve {args.mode}: effective configuration", file=sys.stderr)
    _say(effective_config_lines(loaded, api_key), "")
    config_file = plan.model_path / "config.json"
    # before the GPU check: a split the model cannot take is wrong on any machine
    if config_file.is_file():
        config = json.loads(config_file.read_text())
        refusal = tensor_parallel_refusal(config, plan.tensor_parallel, str(plan.model_path)) or (
            kv and head_layout_refusal(kv, config, plan.tensor_parallel)
        )
        if refusal:
            print(f"hyperqwen serve {args.mode}: refusing to start: {refusal}", file=sys.stderr)
            return EXIT_BAD_SETTINGS

    if no_gpu:
        print(
            f"hyperqwen serve {args.mode}: no CUDA GPU here ({no_gpu}).\n"
            f"Serving needs {REQUIREMENT}.\n"
            "To see the vLLM command without a GPU: PRINT_ARGV=1 hyperqwen serve "
            f"{args.mode}. To check this machine: hyperqwen doctor.",
            file=sys.stderr,
        )
        return EXIT_NO_GPU
    print(
        f"GPU: {', '.join(f'{g.name} ({g.sm}, {g.memory_gib:.0f} GiB)' for g in gpus)}",
        file=sys.stderr,
    )
    if not (plan.model_path / "config.json").is_file():
        print(
            f"hyperqwen serve {args.mode}: no model at {plan.model_path} (config.json missing).\n"
            "Run `hyperqwen prepare` first, or set MODEL to a model folder (MODELS_DIR/MODEL).",
            file=sys.stderr,
        )
        return EXIT_BAD_SETTINGS
    if importlib.util.find_spec("vllm") is None:
        print(
            "hyperqwen serve: vLLM is not installed for this Python; run bash install.sh.",
            file=sys.stderr,
        )
        return EXIT_BAD_SETTINGS
    if refusal := unregistered_plugin_refusal({**environ, **plan.env}):
        print(f"hyperqwen serve {args.mode}: refusing to start: {refusal}", file=sys.stderr)
        return EXIT_BAD_SETTINGS
    sys.stdout.flush()
    sys.stderr.flush()
    # vLLM's own CLI module under this interpreter: the pinned (patched) vLLM of this
    # environment runs, whatever `vllm` happens to be first on PATH.
    command = [sys.executable, "-m", VLLM_CLI_MODULE, *plan.argv[1:]]
    toolkit, why = toolkit_env(environ)
    if toolkit:
        print(
            f"CUDA toolkit for JIT kernels: {toolkit['CUDA_HOME']} (the venv's: {why})",
            file=sys.stderr,
        )
        if "LIBRARY_PATH" in toolkit:
            folder = toolkit["LIBRARY_PATH"].split(os.pathsep)[0]
            print(f"JIT links (-lcudart, -lcuda) search {folder} first", file=sys.stderr)
    os.execve(sys.executable, command, {**environ, **toolkit, **plan.env})


def cmd_doctor(args: argparse.Namespace) -> int:
    environ = dict(os.environ)
    checks, code = doctor.run_doctor(environ, in_container(environ))
    for check in checks:
        print(check.line())
    print("\nall good" if code == 0 else "\nFAIL above: fix those before serving")
    return code


def cmd_settings(args: argparse.Namespace) -> int:
    if args.env_example:
        sys.stdout.write(docs.env_example())
        return 0
    if args.markdown:
        sys.stdout.write(docs.knob_table(args.markdown))
        return 0
    if args.write_docs:
        for path in docs.write_docs(Path(args.write_docs)):
            print(f"wrote {path}")
        return 0
    try:
        loaded = load_settings()
    except SettingsError as error:
        print(error, file=sys.stderr)
        return EXIT_BAD_SETTINGS
    api_key, _ = resolve_api_key(loaded.settings)
    print("\n".join(effective_config_lines(loaded, api_key)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hyperqwen",
        description="Serve large Qwen models fast on consumer NVIDIA cards (a pinned, patched "
        "vLLM 0.26.0). Knobs come from the environment and .env; see .env.example.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser(
        "serve",
        help="start the OpenAI-compatible server (single: chat + speculative decoding; "
        "batch: many concurrent requests)",
        description="Start vLLM with the settings of MODE. single: few slots, speculative "
        "decoding, 64k context (CTX picks longer); batch: 64 slots, no speculation, 150k "
        "context with an fp8 KV cache. Exit 2: invalid knob; exit 3: no CUDA GPU.",
    )
    serve.add_argument("mode", choices=MODES)
    serve.add_argument(
        "--print-argv",
        action="store_true",
        help="print the vllm command, one argument per line, and exit (no GPU "
        "needed; same as PRINT_ARGV=1)",
    )
    serve.add_argument(
        "--env-file",
        help="read knobs from this file instead of $ENV_FILE or "
        "./.env (the environment still wins)",
    )
    serve.set_defaults(func=cmd_serve)

    check = sub.add_parser(
        "doctor",
        help="check this machine: versions, patches, GPU, model, access",
        description="One line per check, OK/WARN/FAIL with the fix. Exits 1 when anything FAILs.",
    )
    check.set_defaults(func=cmd_doctor)

    knobs = sub.add_parser(
        "settings",
        help="show the effective knobs, or generate their docs",
        description="Without options: the effective knobs (key redacted).",
    )
    group = knobs.add_mutually_exclusive_group()
    group.add_argument("--env-example", action="store_true", help="print .env.example")
    group.add_argument("--markdown", choices=MODES, help="print the knob table of a mode")
    group.add_argument(
        "--write-docs",
        metavar="ROOT",
        help="rewrite ROOT/.env.example and the "
        "knob tables in ROOT/single-user/README.md and ROOT/batch/README.md",
    )
    knobs.set_defaults(func=cmd_settings)

    capacity_cli.add_subcommand(sub)
    patches_cli.add_subcommand(sub)
    synth.add_subcommand(sub)
    prepare_cli.add_subcommand(sub)
    drafter_cli.add_subcommand(sub)
    bench.add_subcommand(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

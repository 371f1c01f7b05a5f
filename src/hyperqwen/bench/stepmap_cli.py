"""`hyperqwen bench stepmap`: the map of one served C1 decode step (bench/stepmap.py), as rows
of a result file and a table."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from hyperqwen.bench.client import BenchClient, BenchError
from hyperqwen.bench.results import (
    ComparisonRow,
    ResultFileError,
    aligned,
    comparison_row,
    load_result,
)
from hyperqwen.bench.stephost import host_lines, host_rows, host_summary
from hyperqwen.bench.stepmap import (
    GAP_SPLIT_US,
    LM_HEAD,
    ModelFacts,
    model_facts,
    segment,
    summarize_steps,
)
from hyperqwen.exit_codes import EXIT_BAD_INPUT, EXIT_FAILED

DEFAULT_STEPS = 24


def body_speed(gemms: dict) -> tuple[float, float] | None:
    """(ms per step, GB/s) of the body GEMMs at one M, every kind but the lm_head; None where
    none ran."""
    body = [row for name, row in gemms.items() if name != LM_HEAD]
    moved = sum(row["launches_per_step"] * row["bytes_per_launch"] for row in body)
    ms = sum(row["ms_per_step"] for row in body)
    return (round(ms, 4), round(moved / ms / 1e6, 1)) if ms else None


def _fraction(gbps: float, copy_gbps: float | None) -> float | None:
    return None if copy_gbps is None else round(gbps / copy_gbps, 3)


def figures(summary: dict, copy_gbps: float | None) -> list[tuple[str, str, float | None]]:
    """(row name, unit, value) of a step map."""
    rows = [
        ("steps", "steps", summary["steps"]),
        ("step_gpu_ms", "ms", summary["step_gpu_ms"]),
        ("step_span_ms", "ms", summary["step_span_ms"]),
        ("step_busy_ms", "ms", summary["step_busy_ms"]),
        ("idle_ms_per_step", "ms", summary["idle_ms"]),
        ("idle_short_gaps_ms_per_step", "ms", summary["idle_short_gaps_ms"]),
        ("idle_long_gaps_ms_per_step", "ms", summary["idle_long_gaps_ms"]),
        ("gaps_per_step", "gaps", summary["gaps_per_step"]),
        ("graph_replays_per_step", "replays", summary["graph_replays_per_step"]),
        ("graph_busy_ms_per_step", "ms", summary["graph_busy_ms"]),
        ("graph_idle_ms_per_step", "ms", summary["graph_idle_ms"]),
        ("outside_graphs_busy_ms_per_step", "ms", summary["outside_graphs_busy_ms"]),
        ("outside_graphs_idle_ms_per_step", "ms", summary["outside_graphs_idle_ms"]),
        ("launches_per_step", "launches", summary["launches_per_step"]),
    ]
    for name, entry in summary["classes"].items():
        rows.append((f"step_ms_{name}", "ms", entry["ms_per_step"]))
        rows.append((f"launches_{name}", "launches", entry["launches_per_step"]))
    for m, gemms in summary["gemms"].items():
        if speed := body_speed(gemms):
            ms, gbps = speed
            rows.append((f"body_ms_m{m}", "ms", ms))
            rows.append((f"body_gbps_m{m}", "GB/s", gbps))
            rows.append((f"body_bw_fraction_m{m}", "fraction", _fraction(gbps, copy_gbps)))
        for name, entry in gemms.items():
            prefix = LM_HEAD if name == LM_HEAD else f"body_{name}"
            fraction = _fraction(entry["gbps"], copy_gbps)
            rows.append((f"{prefix}_bw_fraction_m{m}", "fraction", fraction))
    if copy_gbps is not None:
        rows.append(("copy_bandwidth", "GB/s", round(copy_gbps)))
    if summary.get("host"):
        rows += [(name, unit, value) for name, (unit, value) in host_rows(summary["host"]).items()]
    return rows


def stepmap_rows(summary: dict, copy_gbps: float | None, before: dict | None) -> list:
    """Result rows: this map in `patched`, the same row of an earlier map (--before) in
    `stock`."""
    earlier = {row["name"]: row["patched"] for row in (before or {}).get("rows", [])}
    return [
        comparison_row(name, unit, earlier.get(name), value)
        for name, unit, value in figures(summary, copy_gbps)
    ]


def format_stepmap(summary: dict, copy_gbps: float | None) -> list[str]:
    """The map as text: step totals and idle, classes, GEMMs by M, unclassified kernels, gaps."""
    lines = [
        f"{summary['steps']} decode steps (tokens per step: {summary['steps_by_tokens']}; "
        f"{summary['steps_left_out']} other step(s) left out); forward GEMMs matched to the "
        f"geometry in {summary['gemm_order_matched_steps']} of them "
        f"({summary['forward_gemms_expected']} expected per forward)",
        f"per step: GPU {summary['step_gpu_ms']} ms of ops, window {summary['step_span_ms']} ms, "
        f"busy {summary['step_busy_ms']} ms, idle {summary['idle_ms']} ms in "
        f"{summary['gaps_per_step']} gaps (below {summary['gap_split_us']:g} us: "
        f"{summary['idle_short_gaps_ms']} ms; the rest {summary['idle_long_gaps_ms']} ms), "
        f"{summary['launches_per_step']} launches",
        f"CUDA graphs: {summary['graph_replays_per_step']} replays per step, busy "
        f"{summary['graph_busy_ms']} ms, idle between their kernels {summary['graph_idle_ms']} "
        f"ms; outside them: eager ops busy {summary['outside_graphs_busy_ms']} ms, idle "
        f"{summary['outside_graphs_idle_ms']} ms (the host preparing and waiting)",
        "",
    ]
    table = [("class", "launches/step", "ms/step", "share")]
    for name, entry in summary["classes"].items():
        share = entry["ms_per_step"] / summary["step_gpu_ms"] if summary["step_gpu_ms"] else 0
        table.append(
            (name, f"{entry['launches_per_step']:g}", f"{entry['ms_per_step']:.4f}", f"{share:.1%}")
        )
    lines += [*aligned(table), ""]
    table = [("GEMM", "M", "launches/step", "ms/step", "us/launch", "MB/launch", "GB/s", "of copy")]
    for m, gemms in summary["gemms"].items():
        for name, entry in gemms.items():
            fraction = _fraction(entry["gbps"], copy_gbps)
            table.append(
                (
                    name,
                    m,
                    f"{entry['launches_per_step']:g}",
                    f"{entry['ms_per_step']:.4f}",
                    f"{1000 * entry['ms_per_step'] / entry['launches_per_step']:.1f}",
                    f"{entry['bytes_per_launch'] / 1e6:.1f}",
                    f"{entry['gbps']:g}",
                    "-" if fraction is None else f"{fraction:.3f}",
                )
            )
        if speed := body_speed(gemms):
            ms, gbps = speed
            fraction = _fraction(gbps, copy_gbps)
            shown = "-" if fraction is None else f"{fraction:.3f}"
            table.append(("body, all kinds", m, "", f"{ms:.4f}", "", "", f"{gbps:g}", shown))
    lines += aligned(table)
    copy = "not measured" if copy_gbps is None else f"{copy_gbps:.0f} GB/s"
    lines += [f"copy bandwidth: {copy}", ""]
    if summary["other_kernels"]:
        lines.append("kernels no class claims (class other):")
        lines += [
            f"  {k['ms_per_step']:.4f} ms, {k['launches_per_step']:g}x  {k['name']}"
            for k in summary["other_kernels"]
        ]
    if summary["long_gaps"]:
        lines.append(f"gaps of {summary['gap_split_us']:g} us or more, by the ops around them:")
        lines += [
            f"  {g['ms_per_step']:.4f} ms, {g['count_per_step']:g}x  {g['before']} -> {g['after']}"
            for g in summary["long_gaps"]
        ]
    if summary.get("host"):
        lines += host_lines(summary["host"])
    return lines


def server_flags(trace_dir: Path, steps: int) -> list[str]:
    """The server's --profiler-config for a map of `steps` decode steps: one range more, as
    a step ends where the next one's range starts."""
    from hyperqwen.bench.profile import PROFILE_DELAY_STEPS, profiler_flags

    return profiler_flags(trace_dir, steps + 1, PROFILE_DELAY_STEPS)


def measured_copy_gbps() -> float | None:
    """The device-to-device copy bandwidth of GPU 0 measured here, or None where this process
    has no CUDA GPU or too little free memory beside the server (then pass --copy-gbps)."""
    try:
        import torch

        from hyperqwen.bench.timing import copy_bandwidth_gbps

        return copy_bandwidth_gbps() if torch.cuda.is_available() else None
    except (ImportError, RuntimeError) as reason:  # torch.OutOfMemoryError is a RuntimeError
        print(f"bench stepmap: copy bandwidth not measured ({reason})", file=sys.stderr)
        return None


def gpu_fact() -> str:
    try:
        import torch

        from hyperqwen.bench.timing import gpu_label

        return gpu_label() if torch.cuda.is_available() else "not measured (no CUDA GPU here)"
    except ImportError as reason:
        return f"not measured ({reason})"


def served_model_dir(client: BenchClient, model: str) -> Path:
    """The folder the server loaded (vLLM's /v1/models `root`)."""
    for card in client.get_json("/v1/models").get("data") or []:
        if card.get("id") == model and card.get("root"):
            return Path(card["root"])
    raise BenchError(
        f"/v1/models does not say which folder {model} was loaded from: pass --model-dir"
    )


def profile_server(args: argparse.Namespace) -> tuple[Path, Path, str, str]:
    """Profile one C1 request on the running server: (trace, model folder, vLLM, server)."""
    from hyperqwen.bench.header import patch_fact, server_version
    from hyperqwen.bench.options import local_server
    from hyperqwen.bench.profile import profile_one_request
    from hyperqwen.bench.run import served_model
    from hyperqwen.bench.workload import RequestFactory, served_token_ids
    from hyperqwen.settings import load_settings

    loaded = load_settings(env_file=Path(args.env_file) if args.env_file else None)
    url, api_key = local_server(loaded, args.url)
    client = BenchClient(url, api_key, args.timeout)
    model, _ = served_model(client, args.model)
    model_dir = Path(args.model_dir) if args.model_dir else served_model_dir(client, model)
    factory = RequestFactory(
        model, seed=0, temperature=0.0, token_ids=served_token_ids(client, model)
    )
    trace = profile_one_request(client, factory, args.input_len, args.steps, Path(args.trace_dir))
    vllm = f"{server_version(client)} served; this Python's vLLM: patch series {patch_fact()}"
    return trace, model_dir, vllm, f"{model} at {client.base_url}"


def result_document(summary: dict, rows: list[ComparisonRow], facts: dict, trace: Path) -> dict:
    from hyperqwen.bench.results import result_document as checked_document

    notes = [
        "One C1 request's decode steps from vLLM's torch profiler (CPU and CUDA activity: vLLM "
        "0.26's worker records both). A step runs on the GPU from the start of its "
        "execute_context range to the next one's; its forward ends with the range, then "
        "sampling, rejection and the MTP drafter run. Values are means per step; patched = "
        "this run, stock = the same row of the --before map where given.",
        "GEMM bytes = weights + group scales + x + y at the step's M (the forward's tokens), "
        "from the served config.json; the forward's weight-only GEMMs are matched to the "
        "geometry's layers in launch order. bw_fraction = GB/s over the copy bandwidth "
        "(device-to-device, read + written) measured in the bench process or given.",
        "idle = the step's window less the union of its GPU ops; short gaps are those below "
        f"{summary['gap_split_us']:g} us (kernel to kernel inside a graph), long ones the "
        "host's share. graph_* = ops a cudaGraphLaunch ran (matched by correlation id) and the "
        "gaps between two ops of one replay; outside_graphs_* = eager ops and every other gap.",
        "profiled_host_* = the host thread that opens the step ranges, from one decode step "
        "range's start to the next (bench/stephost.py): waiting on the GPU (blocking CUDA "
        "calls), launching, other recorded ops, and time in no recorded op (untraced Python: "
        "scheduling, output processing). The profiler slows the host, so these describe the "
        "profiled steps; bench ab's c1_host_cpu_* rows measure unprofiled ones.",
    ]
    return checked_document(facts, rows, notes=notes, stepmap=summary, trace=str(trace))


def cmd_stepmap(args: argparse.Namespace) -> int:
    from hyperqwen.bench.header import git_commit
    from hyperqwen.bench.profile import ProfileError, load_trace

    if args.server_flags:
        print(shlex.join(server_flags(Path(args.trace_dir), args.steps)))
        return 0
    if args.trace and not args.model_dir:
        print("bench stepmap: --trace needs --model-dir (the served config.json)", file=sys.stderr)
        return EXIT_BAD_INPUT
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    try:
        before = load_result(Path(args.before))[0] if args.before else None
        if args.trace:
            trace, model_dir = Path(args.trace), Path(args.model_dir)
            vllm, served = "not asked (an earlier trace)", f"the model of {model_dir}"
        else:
            trace, model_dir, vllm, served = profile_server(args)
        facts: ModelFacts = model_facts(json.loads((model_dir / "config.json").read_text()))
        events = load_trace(trace)
        steps, left_out = segment(events)
    except (BenchError, ProfileError, ResultFileError, ValueError, OSError) as error:
        print(f"bench stepmap: {error}", file=sys.stderr)
        return EXIT_FAILED
    summary = summarize_steps(steps, facts, args.gap_split_us, left_out)
    try:
        summary["host"] = host_summary(events)
    except ProfileError as reason:  # the GPU's map stands without the host's
        print(f"bench stepmap: no host map ({reason})", file=sys.stderr)
    copy_gbps = args.copy_gbps or measured_copy_gbps()
    rows = stepmap_rows(summary, copy_gbps, before)
    command = ["hyperqwen", "bench", "stepmap", *sys.argv[3:]]
    document = result_document(
        summary,
        rows,
        {
            "gpu": gpu_fact(),
            "vllm": vllm,
            "commit": args.commit or git_commit(),
            "date": started,
            "command": shlex.join(command),
            "model": f"{served} (lm_head {facts.lm_head_bits}-bit)",
        },
        trace,
    )
    out = Path(args.out or f"bench-results/stepmap-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(document, indent=1) + "\n")
    print("\n".join(format_stepmap(summary, copy_gbps)))
    print(f"bench stepmap: wrote {out}", file=sys.stderr)
    return 0


DESCRIPTION = f"""\
Map one served C1 decode step kernel by kernel: per class (the body's weight-only GEMMs by layer
kind and M, lm_head, attention, GDN, dense GEMMs, norms and activations, splits and copies,
sampling and rejection, the MTP drafter, other) the launches and GPU time per step; per GEMM
the bytes it moves (from the model's config.json) and its bandwidth, also as a fraction of the
copy bandwidth; the GPU's idle time inside the step, in gaps between kernels (below
--gap-split-us) and the host's; and where the host thread's time goes from one step's start to
the next (waiting on the GPU, launching, other recorded ops, untraced Python).

The server must run with vLLM's torch profiler, writing to --trace-dir on this machine:
  hyperqwen bench stepmap --server-flags --trace-dir /tmp/stepmap-trace
prints the --profiler-config to add to the server's argv (e.g. in EXTRA_ARGS). Then:
  hyperqwen bench stepmap --trace-dir /tmp/stepmap-trace --out stepmap.json
sends one C1 request of random tokens between /start_profile and /stop_profile and maps the
{DEFAULT_STEPS} decode steps (--steps, the same number both times) that follow the first
few. --trace FILE --model-dir DIR maps a trace written earlier instead, without a server.
The result file (docs/results schema) holds the rows; --before an earlier map puts its rows in
the stock column. Exit codes: 0 done, 1 the server, trace or model failed, 2 bad options."""


def add_subcommand(actions) -> None:
    parser = actions.add_parser(
        "stepmap",
        help="one served decode step kernel by kernel: time, bytes, bandwidth, idle gaps",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--trace-dir",
        default="/tmp/hyperqwen-stepmap-trace",
        metavar="DIR",
        help="where the server's profiler writes (default %(default)s)",
    )
    parser.add_argument(
        "--steps", type=int, default=DEFAULT_STEPS, help="decode steps to map (default %(default)s)"
    )
    parser.add_argument(
        "--server-flags",
        action="store_true",
        help="print the server's --profiler-config for --trace-dir and --steps",
    )
    parser.add_argument("--url", metavar="URL", help="server address (default 127.0.0.1:$PORT)")
    parser.add_argument("--model", metavar="ID", help="model id (default: the first served)")
    parser.add_argument("--env-file", metavar="FILE", help="read PORT and the API key from it")
    parser.add_argument(
        "--model-dir",
        metavar="DIR",
        help="the served folder, for its config.json (default: /v1/models root)",
    )
    parser.add_argument("--trace", metavar="FILE", help="map this trace; no server")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens (default 128)")
    parser.add_argument("--timeout", type=float, default=600.0, help="request read timeout, s")
    parser.add_argument(
        "--copy-gbps",
        type=float,
        metavar="GB/S",
        help="the copy bandwidth to compare with (default: measured here)",
    )
    parser.add_argument(
        "--gap-split-us",
        type=float,
        default=GAP_SPLIT_US,
        help="gaps below this are kernel-to-kernel (default %(default)s)",
    )
    parser.add_argument(
        "--before", metavar="RESULT.json", help="an earlier map, for the stock column"
    )
    parser.add_argument("--out", metavar="PATH", help="result JSON (default bench-results/...)")
    parser.add_argument("--commit", help="the checkout's commit (default: git describe)")
    parser.set_defaults(func=cmd_stepmap)

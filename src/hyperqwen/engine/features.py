"""HyperQwen's engine features, each declared once.

A feature is code HyperQwen runs inside vLLM's processes (a module here, over a kernel in
../kernels), called at one or more seams of vLLM (a `Seam` below: a hook in patches/ that calls
the function of that name in seams.py, which calls the same-named function of each feature
module on it that is switched on), switched by one knob that the launcher turns into one
environment variable. Its declaration below (the Gated DeltaNet layers' in features_gdn.py,
the KV cache's in features_kv.py, quoting's in features_lookup.py, imported here) is all the
rest of the project knows of it: Settings builds the knob from it, the launcher sets the
variable with it, vLLM's compile cache key, `hyperqwen doctor`, the generated knob tables and
engine/README.md's table read it, `hyperqwen prepare` runs its prepare step, and in vLLM's
process seams.py asks `switched_on(FEATURE)` before it calls the module. Elsewhere code reads
the declarations generically (FEATURES, a seam's features, a field), never by a feature's name:
tests/test_engine_feature_places.py.

Adding a kernel or drafter: its module (a function per seam it hooks), one `Feature` in
FEATURES, its tests; a new seam (feature_model.py) only where vLLM has none of those there
to offer.

This module runs inside vLLM: it imports the standard library only (no settings, no pydantic).
A `launch` or `ignored` function gets the Settings object and reads its knobs by attribute.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any

from hyperqwen.engine.feature_model import (  # re-exported: features.X is the API
    ATTENTION_KV_SPEC as ATTENTION_KV_SPEC,
    BATCH_MODE as BATCH_MODE,
    BOTH_MODES as BOTH_MODES,
    COMPILE_CACHE_INITIALIZED as COMPILE_CACHE_INITIALIZED,
    GDN_LAYER_BUILT as GDN_LAYER_BUILT,
    GDN_MIXED_QKV as GDN_MIXED_QKV,
    GDN_MODULE_LOADED as GDN_MODULE_LOADED,
    GDN_STEP_BEGINS as GDN_STEP_BEGINS,
    GDN_VERIFY as GDN_VERIFY,
    LINEAR_KERNELS as LINEAR_KERNELS,
    NGRAM_DRAFTS as NGRAM_DRAFTS,
    OFF as OFF,
    ON as ON,
    PROPOSER_LOADED as PROPOSER_LOADED,
    RUNNER_ALIGN_COPIED as RUNNER_ALIGN_COPIED,
    RUNNER_ALIGN_COPIES as RUNNER_ALIGN_COPIES,
    RUNNER_COPIES_SCHEDULER_OUTPUT as RUNNER_COPIES_SCHEDULER_OUTPUT,
    RUNNER_COUNTS_ON_GPU as RUNNER_COUNTS_ON_GPU,
    RUNNER_CUT_DRAFTS as RUNNER_CUT_DRAFTS,
    RUNNER_DRAFT_COUNT as RUNNER_DRAFT_COUNT,
    RUNNER_DRAFTED as RUNNER_DRAFTED,
    RUNNER_DRAFTER_BUILT as RUNNER_DRAFTER_BUILT,
    RUNNER_GRAPHS_DISPATCHED as RUNNER_GRAPHS_DISPATCHED,
    RUNNER_KEEPS_NGRAM_BUFFER as RUNNER_KEEPS_NGRAM_BUFFER,
    RUNNER_STEP_BEGINS as RUNNER_STEP_BEGINS,
    SCHEDULER_MAMBA_SPLIT as SCHEDULER_MAMBA_SPLIT,
    SINGLE_MODE as SINGLE_MODE,
    SWITCH as SWITCH,
    V2_RUNNER as V2_RUNNER,
    Feature as Feature,
    FeatureSwitchError as FeatureSwitchError,
    Knob as Knob,
    Seam as Seam,
    env_value as env_value,
    switched_on as switched_on,
)
from hyperqwen.engine.features_gdn import (  # re-exported: features.X is the API
    GDN_BA as GDN_BA,
    GDN_RECURRENT as GDN_RECURRENT,
    GDN_REPLAY as GDN_REPLAY,
    SPLIT_QKV as SPLIT_QKV,
)
from hyperqwen.engine.features_kv import (  # re-exported: features.X is the API
    KVARN as KVARN,
    KVARN_V_BITS as KVARN_V_BITS,
)
from hyperqwen.engine.features_lookup import (  # re-exported: features.X is the API
    GPU_DRAFTS_MAX as GPU_DRAFTS_MAX,
    LOOKUP as LOOKUP,
    LOOKUP_FILLED as LOOKUP_FILLED,
    LOOKUP_ON_GPU as LOOKUP_ON_GPU,
    MTP_DRAFTS as MTP_DRAFTS,
    draft_width_refusal as draft_width_refusal,
)

# LINEAR_BACKEND's one value vLLM does not know: vLLM gets marlin, the engine HYPERQWEN_W4A16=1
OUR_LINEAR_BACKEND = "hyperqwen"
W4A16_LINEAR = Feature(
    name="w4a16_linear",
    seams=(LINEAR_KERNELS,),
    env="HYPERQWEN_W4A16",
    own_files=("src/hyperqwen/kernels/w4a16.py", "src/hyperqwen/bench/kernels.py"),
    knob="LINEAR_BACKEND",
    turned_on_by=f"LINEAR_BACKEND={OUR_LINEAR_BACKEND}",
    launch=lambda settings, mode: ON if settings.LINEAR_BACKEND == OUR_LINEAR_BACKEND else None,
    status="off (on with LINEAR_BACKEND=hyperqwen); vLLM's compressed-tensors W4A16 layers run "
    "`../kernels/w4a16.py` from one copy of their weights in its tiles, at every M (a torch "
    "custom op, opaque to torch.compile), Marlin where it cannot serve (the int8 heads); "
    "CPU-tested with vLLM's own parameter classes (`tests/test_engine_w4a16_linear.py`); level "
    "with Marlin at M = 1 and 7 % slower at M = 4 in kernel timings on the H200 "
    "(`docs/results/2026-12-01-h200-27b-w4a16-kernels-tiles.json`); not run in a server yet",
)


def _layer_sets(groups: tuple[str, ...]) -> tuple[str, ...]:
    """INT8_ACT's values that name layers: each proper subset of `groups` (in their order,
    joined by +), then all of them."""
    subsets = [
        "+".join(subset)
        for size in range(1, len(groups))
        for subset in itertools.combinations(groups, size)
    ]
    return (*subsets, INT8_ALL)


# INT8_ACT's layer groups (engine/w4a8_linear.py reads a layer's group from its prefix):
# mlp: gate_up/down; attn: full attention's qkv/o; gdn: Gated DeltaNet's in_proj_qkvz/out_proj
INT8_LAYER_GROUPS = ("mlp", "attn", "gdn")
INT8_ALL = "all"

W4A8_LINEAR = Feature(
    name="w4a8_linear",
    seams=(LINEAR_KERNELS,),
    checked_at_serve=True,
    own_files=("src/hyperqwen/engine/w4a8_linear.md",),
    cards="sm80/86/89 (A100, RTX 3090/4090): Marlin with int8 activations (vLLM's "
    "`VLLM_MARLIN_INPUT_DTYPE=int8` path, chosen per layer; not measured on these cards); sm90 "
    "(H100/H200): refused before start, vLLM's W4A16 kernel was faster than CUTLASS W4A8 fp8 and "
    "Marlin int8 at the 27B's shapes (docs/results/2026-12-02-h200-27b-kernels-w4a8.json; "
    "humming's W4A8 not timed yet); any other architecture refused by name before start",
    env="HYPERQWEN_INT8_ACT",
    knob="INT8_ACT",
    owned_knob=Knob(
        OFF,
        "Batch mode: 8-bit activations into the int4 (W4A16 g128) body GEMMs of these layer "
        "groups: mlp (gate_up, down), attn (full attention's qkv, o), gdn (Gated DeltaNet's "
        "in_proj_qkvz, out_proj), joined by + (mlp+gdn), or all; 0: off. Each token's "
        "activations are quantized on the fly; the kernel per GPU architecture comes from a "
        "declared table (src/hyperqwen/engine/w4a8_linear.py): Marlin with int8 activations on "
        "sm80/86/89 (neither speed nor perplexity measured there yet: batch/README.md). Refused "
        "before start on sm90, where vLLM's W4A16 kernel was faster than each 8-bit candidate "
        "timed, on other architectures, and for checkpoints with zero points or activation "
        "order. Other layers keep LINEAR_BACKEND's kernel.",
        values=(OFF, *_layer_sets(INT8_LAYER_GROUPS)),
        modes=BATCH_MODE,
    ),
    launch=lambda settings, mode: (
        settings.INT8_ACT if mode == "batch" and settings.INT8_ACT != OFF else None
    ),
    status="off; batch mode's W4A16 body layers of the INT8_ACT groups get 8-bit activations "
    "through the kernel of a per-architecture table (Marlin int8 on sm80/86/89; refused on sm90, "
    "where the H200's kernel timings found no 8-bit candidate faster than W4A16), group scales' "
    "signs folded into the codes where the kernel needs them non-negative; CPU-tested (knob, "
    "per-layer and per-architecture choice, sign fold against float64); on the H200 Marlin int8 "
    "and CUTLASS fp8 answer like float64 (tests/test_engine_w4a8_linear_gpu.py); serving speed "
    "and perplexity not measured (batch/README.md)",
)

DRAFT_VOCAB = Feature(
    name="draft_vocab",
    seams=(PROPOSER_LOADED,),
    env="HYPERQWEN_DRAFT_VOCAB",
    # the drafter package builds the vocabulary, prepare runs its step, the module loads it
    own_files=("src/hyperqwen/drafter", "drafter/README.md"),
    prepare_step="hyperqwen.drafter.step",
    knob="DRAFT_VOCAB",
    unset="auto",
    owned_knob=Knob(
        "auto",
        "With SPEC=mtp: the drafter scores only the draft vocabulary prepare cut (40,960 ids, "
        "hyperqwen-draft-head.safetensors in the model folder) instead of all 248,320, and each "
        "draft token reads a sixth of the head. Output is unchanged (the model verifies every "
        "draft against the full vocabulary). auto: on when the file exists; off: full head.",
        values=("auto", "off"),
        modes=SINGLE_MODE,
    ),
    launch=lambda settings, mode: settings.DRAFT_VOCAB if mode == "single" else None,
    status="on by default (auto: where the prepared model folder has "
    "`hyperqwen-draft-head.safetensors`; the server log then says `draft vocabulary: 40960 of "
    "248320 ids`); MTP's drafter scores the 40,960 rows prepare cut (`drafter/README.md`) in bf16 "
    "instead of the whole lm_head and maps the winner back to its id, a token outside them is "
    "never drafted, verification keeps the full vocabulary; CPU-tested with vLLM's Qwen3_5MTP "
    "(`tests/test_synth.py`); alone it is worth 1.42x against 1.34x stock-MTP at C1 (H200, "
    "DRAFT_VOCAB=off ablation, 2026-12-01, `docs/results/2026-12-01-h200-27b-single-overlap"
    "-novocab.json`: the draft passes read the bf16 draft head, not the int8 lm_head through "
    "Marlin); acceptance on real weights and the greedy GPU test "
    "(`tests/test_engine_draft_vocab_gpu.py`) not run; dummy-weight runs: `hyperqwen synth "
    "--config-only --draft-head`",
)


def _draft_head_int8_ignored(settings: Any, mode: str) -> str | None:
    if mode != "single" or settings.DRAFT_HEAD_INT8 != ON:
        return None
    if settings.SPEC != "mtp":
        return f"DRAFT_HEAD_INT8 is ignored with SPEC={settings.SPEC} (it scores MTP's drafts)."
    if settings.DRAFT_VOCAB == "off":
        return "DRAFT_HEAD_INT8 is ignored with DRAFT_VOCAB=off (it reads the draft head's rows)."
    return None


DRAFT_HEAD_INT8 = Feature(
    name="draft_head_int8",
    seams=(PROPOSER_LOADED,),
    env="HYPERQWEN_DRAFT_HEAD_INT8",
    own_files=("src/hyperqwen/kernels/draft_argmax.py", "src/hyperqwen/bench/draft_head.py"),
    knob="DRAFT_HEAD_INT8",
    owned_knob=Knob(
        "0",
        "With SPEC=mtp and the draft vocabulary: MTP's greedy drafts score the draft head's "
        "int8 rows (as prepare stores them) in one fused launch, GEMV, argmax and id map "
        "(src/hyperqwen/kernels/draft_argmax.py), instead of its rows dequantized to bf16 "
        "through cuBLAS and three small launches (0.30 ms of a 9.76 ms 27B MTP step on the "
        "H200: docs/results/2026-12-05-h200-27b-single-step-head.json). Output unchanged "
        "(every draft is verified). With DRAFT_SAMPLE=greedy the bf16 rows are freed (0.2 GiB "
        "less for the 27B); probabilistic keeps them beside the int8 copy (0.2 GiB more). The "
        "kernel alone takes under half the bf16 path's time on an H100 "
        "(docs/results/2026-12-05-h100-27b-draft-head.json); off by default until a served "
        "step is measured with it.",
        modes=SINGLE_MODE,
    ),
    launch=lambda settings, mode: (
        ON
        if mode == "single"
        and settings.DRAFT_HEAD_INT8 == ON
        and settings.SPEC == "mtp"
        and settings.DRAFT_VOCAB != "off"
        else None
    ),
    ignored=_draft_head_int8_ignored,
    checked_at_serve=True,  # a draft head that is missing or not int8 is refused by name
    # it replaces a method the proposer calls outside the drafter's compiled graph
    changes_compiled_graph=False,
    status="off; MTP's greedy drafts from the draft head's int8 rows in one launch of "
    "`../kernels/draft_argmax.py` (GEMV, argmax over the rows, map to vocabulary ids) in place "
    "of vLLM's LocalArgmaxMixin.get_top_tokens over the bf16 rows; CPU-tested (kernel against "
    "float64 at the 27B's head, the drafter's method against the bf16 path's ids, the bf16 rows "
    "freed under greedy drafts); compiles for sm80-sm120; on an H100 the kernel is exact "
    "(tests/test_kernel_draft_argmax_gpu.py) and timed against vLLM's path and Marlin int8 "
    "(docs/results/2026-12-05-h100-27b-draft-head.json); not served on a GPU yet",
)

ALIGN_OVERLAP = Feature(
    name="align_overlap",
    seams=(RUNNER_STEP_BEGINS, RUNNER_COUNTS_ON_GPU),
    env="HYPERQWEN_ALIGN_OVERLAP",
    knob="PREFIX_CACHE_OVERLAP",
    owned_knob=Knob(
        "1",
        "Single mode, with PREFIX_CACHE=1 and speculative decoding: prepare each step while the "
        "previous one still runs, as without prefix caching; vLLM 0.26 waits for the previous "
        "step's accepted tokens first. H200 27B, C1 TPOT: 3.60 ms with it, 4.23 ms with "
        "vLLM's wait, 3.57 ms without prefix caching. Same tokens as the wait (GPU test, H200; "
        "src/hyperqwen/engine/align_overlap.py).",
        modes=SINGLE_MODE,
    ),
    launch=lambda settings, mode: (
        ON
        if mode == "single" and settings.PREFIX_CACHE_OVERLAP == ON and settings.PREFIX_CACHE == ON
        else None
    ),
    ignored=lambda settings, mode: (
        "PREFIX_CACHE_OVERLAP is ignored with PREFIX_CACHE=0 (nothing to overlap)."
        if mode == "single" and settings.PREFIX_CACHE == OFF
        else None
    ),
    status="on by default in single mode (with PREFIX_CACHE=1): vLLM 0.26 runs prefix caching for "
    "this hybrid model in its mamba `align` mode, whose runner waits for each step's accepted "
    "counts before preparing the next; this skips the wait in every step where no request can "
    "reach a new state block, taking the counts from the GPU; CPU-tested; GPU exactness test "
    "passed (H200, 2026-12-01: same greedy tokens with and without, blocks crossed, overlapped "
    "steps logged, `tests/test_engine_align_overlap_gpu.py`); C1 TPOT 3.60 ms against 4.23 with "
    "vLLM's wait and 3.57 without prefix caching (H200, 78e5dfa, "
    "`docs/results/2026-12-01-h200-27b-single-overlap{,-wait,-nopc}.json`)",
)

ALIGN_WHOLE_PROMPT = Feature(
    name="align_whole_prompt",
    seams=(SCHEDULER_MAMBA_SPLIT,),
    env="HYPERQWEN_ALIGN_WHOLE_PROMPT",
    knob="PREFIX_CACHE_WHOLE_PROMPT",
    own_files=("src/hyperqwen/engine/align_whole_prompt.md",),
    owned_knob=Knob(
        "0",
        "With PREFIX_CACHE=1: prefill a prompt that starts with no cache hit in one step where "
        "the step's budget holds it; vLLM 0.26 stops it at its last cache block boundary and "
        "runs the rest in one more step, for a later request sharing it up to there "
        "(src/hyperqwen/engine/align_whole_prompt.md: why, what is given up, how to measure).",
    ),
    launch=lambda settings, mode: (
        ON if settings.PREFIX_CACHE_WHOLE_PROMPT == ON and settings.PREFIX_CACHE == ON else None
    ),
    ignored=lambda settings, mode: (
        "PREFIX_CACHE_WHOLE_PROMPT does nothing with PREFIX_CACHE=0."
        if settings.PREFIX_CACHE == OFF
        else None
    ),
    changes_compiled_graph=False,
    status="off; a prompt with no cache hit, which mamba `align` mode stops at its last cache "
    "block boundary (one engine step more), runs whole where the step can finish it; "
    "CPU-tested with vLLM's scheduler (one step instead of two, shared prefixes still cached, "
    "every cached state a step's end); greedy answers identical with and without the cache on "
    "the H200 (`tests/test_engine_align_whole_prompt_gpu.py`); TTFT not measured yet "
    "(`align_whole_prompt.md`)",
)

PDL = Feature(
    name="pdl",
    seams=(),  # no seam: the launchers in ../kernels read it (engine/pdl.py decides per card)
    checked_at_serve=True,
    cards="sm90 (H100/H200) and sm120 (RTX 5090; compiled here, not run): PDL with auto or 1; "
    "sm80/86/89 (A100, RTX 3090/4090): never, `auto` off there and `1` refused by `hyperqwen "
    "serve` where it sees the card (logged and ignored where only a kernel's launch sees it), "
    "the kernels' PTX the same as without the knob (checked for sm80/86/89/90/120); on the "
    "H200 the 16-layer chain was slower with it "
    "(docs/results/2026-12-02-h200-27b-pdl-chain.json), so off by default",
    own_files=(
        "src/hyperqwen/kernels/pdl.py",
        "src/hyperqwen/bench/pdl.py",
        "src/hyperqwen/bench/pdl_chain.py",
    ),
    env="HYPERQWEN_PDL",
    knob="PDL",
    owned_knob=Knob(
        OFF,
        "Programmatic dependent launch for HyperQwen's own decode-step kernels (W4A16 GEMM, "
        "GDN recurrent update, b/a projection, q|k|v split): each is launched so that its "
        "prologue and an L2 prefetch of its weights overlap the previous kernel's tail, and "
        "waits for that kernel before it reads anything a kernel wrote (src/hyperqwen/kernels/"
        "README.md). auto: on for sm90 and newer (H100/H200, RTX 5090), off below; 1: the "
        "same, but `hyperqwen serve` refuses it on a card below sm90 (where only a kernel's "
        "launch sees the card: logged, off); 0: off. Same results bit for bit (CPU tests and "
        "the H200's graph-replay test); slower on the H200's kernel chain "
        "(docs/results/2026-12-02-h200-27b-pdl-chain.json), so off by default.",
        values=("auto", OFF, ON),
    ),
    launch=lambda settings, mode: None if settings.PDL == OFF else settings.PDL,
    # it changes how the kernels are launched, inside ops torch.compile does not trace
    changes_compiled_graph=False,
    status="off; with auto or 1 the launchers of `../kernels/` (w4a16, gdn_recurrent, ba_proj, "
    "split_qkv) launch on sm90 and newer with programmatic dependent launch, each kernel "
    "waiting for its predecessor before its first read of a kernel's output and prefetching "
    "its weights into L2 before that; sm80/86/89 launch as without it; same results on and off "
    "(CPU, and the H200 under CUDA-graph replay: tests/test_kernel_pdl_gpu.py); the H200's "
    "chain of 16 GDN layers was slower per layer with it than without "
    "(docs/results/2026-12-02-h200-27b-pdl-chain.json)",
)

# TRITON_CACHE's value that shares one Triton cache across configurations (the default)
SHARED = "shared"

SHARED_TRITON_CACHE = Feature(
    name="shared_triton_cache",
    seams=(COMPILE_CACHE_INITIALIZED,),
    env="HYPERQWEN_TRITON_CACHE",
    knob="TRITON_CACHE",
    unset=SHARED,
    owned_knob=Knob(
        SHARED,
        "Where Triton keeps its compiled kernels and autotuning results. shared: one folder, "
        "VLLM_CACHE_ROOT/triton_cache, for every server configuration, so a server started with "
        "other flags or knobs skips recompiling and re-autotuning them (the Gated DeltaNet "
        "warm-up, bench/measurements/2026-12-03-h200-gdn-replay-warmup.json): paid once per "
        "card, not once per configuration. "
        "Safe because Triton keys each entry by kernel source, options, GPU and Triton version. "
        "off: vLLM's, a fresh folder inside each configuration's compile cache.",
        values=(SHARED, "off"),
    ),
    # unset is shared, so the default launch sets nothing
    launch=lambda settings, mode: None if settings.TRITON_CACHE == SHARED else "off",
    # it moves where kernels are stored, not what any graph or kernel computes
    changes_compiled_graph=False,
    status="on by default (shared); once vLLM's Inductor adaptor has set its cache "
    "directories for this configuration's compile hash, TRITON_CACHE_DIR becomes "
    "VLLM_CACHE_ROOT/triton_cache, one content-addressed Triton cache for every configuration "
    "(the server log says so once); vLLM's compile cache off: not called; CPU-tested with "
    "vLLM's two Inductor adaptors; the warm-up saved on a changed configuration not measured "
    "on a GPU yet",
)

# In this order: Settings adds the owned knobs, the launcher sets the variables and warns.
FEATURES: tuple[Feature, ...] = (
    GDN_REPLAY,
    GDN_RECURRENT,
    GDN_BA,
    SPLIT_QKV,
    W4A16_LINEAR,
    W4A8_LINEAR,
    DRAFT_VOCAB,
    DRAFT_HEAD_INT8,  # after DRAFT_VOCAB: it reads the rows that one installs
    ALIGN_OVERLAP,
    ALIGN_WHOLE_PROMPT,
    LOOKUP,
    PDL,
    KVARN,
    KVARN_V_BITS,
    SHARED_TRITON_CACHE,
)


def serve_refusal(settings: Any, mode: str, gpus: list[Any], model_dir: Path) -> str | None:
    """The first reason a feature gives why `hyperqwen serve MODE` must not start (a knob value
    the GPUs or the model folder cannot take), or None."""
    for feature in FEATURES:
        if reason := feature.refusal(settings, mode):
            return reason
        value = feature.env_for(settings, mode) if feature.checked_at_serve else None
        if value is not None and (reason := feature.code().serve_refusal(value, gpus, model_dir)):
            return reason
    return None


def launch_env(settings: Any, mode: str) -> dict[str, str]:
    """The variables `hyperqwen serve MODE` sets for these settings."""
    values = {feature.env: feature.env_for(settings, mode) for feature in FEATURES}
    return {name: value for name, value in values.items() if value is not None}


def check_environment() -> None:
    """Every feature's variable in this process is one its feature takes; else the
    FeatureSwitchError names it (the vLLM plugin runs this before the model loads)."""
    for feature in FEATURES:
        env_value(feature)


def compile_factors() -> dict[str, str | None]:
    """The graph-changing switches' values, for vLLM's compile cache key (unset is None)."""
    return {f.env: os.environ.get(f.env) for f in FEATURES if f.changes_compiled_graph}

"""HyperQwen's engine features, each declared once.

A feature is code HyperQwen runs inside vLLM's processes (a module here, over a kernel in
../kernels), called at one or more seams of vLLM (a `Seam` below: a hook in patches/ that calls
the function of that name in seams.py, which calls the same-named function of each feature
module on it that is switched on), switched by one knob that the launcher turns into one
environment variable. Its declaration below is all the rest of the project knows of it: Settings
builds the knob from it, the launcher sets the variable with it, vLLM's compile cache key,
`hyperqwen doctor`, the generated knob tables and engine/README.md's table read it, and in
vLLM's process seams.py asks `switched_on(FEATURE)` before it calls the module.

Adding a kernel or drafter: its module (a function per seam it hooks), one `Feature` in
FEATURES, its tests; a new seam only where vLLM has none of the seams below to offer.

This module runs inside vLLM: it imports the standard library only (no settings, no pydantic).
A `launch` or `ignored` function gets the Settings object and reads its knobs by attribute.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

ON, OFF = "1", "0"
SWITCH = (OFF, ON)
BOTH_MODES = ("single", "batch")
SINGLE_MODE = ("single",)
# LINEAR_BACKEND's one value vLLM does not know: vLLM gets marlin, the engine HYPERQWEN_W4A16=1
OUR_LINEAR_BACKEND = "hyperqwen"
# MTP's drafts per step: SPEC=mtp's default DRAFT_TOKENS, and with lookup's quoting (a larger
# DRAFT_TOKENS) what MTP still drafts and a step without a match verifies (engine/quoting.py)
MTP_DRAFTS = 3


class FeatureSwitchError(ValueError):
    """An engine variable holds a value its feature does not take (never read as "off")."""


@dataclass(frozen=True)
class Knob:
    """The Settings knob a feature owns (Settings adds it as a field; its 'becomes' is the
    feature's variable)."""

    default: str
    help: str
    values: tuple[str, ...] = SWITCH
    modes: tuple[str, ...] = BOTH_MODES


@dataclass(frozen=True)
class Seam:
    """A place in vLLM with no extension point, where a patch calls seams.NAME."""

    name: str
    """The function of engine/seams.py the hook calls, and of each feature module on it."""
    patch: str
    where: str
    """Where in vLLM, in words (engine/README.md's table)."""


GDN_MODULE_LOADED = Seam("gdn_module_loaded", "gdn-layer.patch", "the GDN layer module loads")
GDN_LAYER_BUILT = Seam("gdn_layer_built", "gdn-layer.patch", "a GDN layer is built")
GDN_MIXED_QKV = Seam("gdn_mixed_qkv", "gdn-layer.patch", "the GDN layer's `rearrange_mixed_qkv`")
LINEAR_KERNELS = Seam(
    "linear_kernels", "linear-kernels.patch", "vLLM's choice of mixed-precision linear kernel"
)
PROPOSER_LOADED = Seam(
    "proposer_loaded", "proposer-loaded.patch", "a speculative proposer's model is loaded, V1/V2"
)
NGRAM_DRAFTS = Seam("ngram_drafts", "ngram-drafts.patch", "vLLM's CPU n-gram proposer")
ATTENTION_KV_SPEC = Seam(
    "attention_kv_spec",
    "attention-kv-spec.patch",
    "an attention layer's KV cache spec, and the hybrid page alignment's bytes per token",
)


def _v1_runner_seam(name: str, where: str) -> Seam:
    """A seam of the V1 runner (v1-runner.patch)."""
    return Seam(name, "v1-runner.patch", f"V1 runner: {where}")


RUNNER_DRAFTER_BUILT = _v1_runner_seam("runner_drafter_built", "drafter built")
RUNNER_KEEPS_NGRAM_BUFFER = _v1_runner_seam("runner_keeps_ngram_buffer", "n-gram token buffer kept")
RUNNER_STEP_BEGINS = _v1_runner_seam("runner_step_begins", "a step begins")
RUNNER_COUNTS_ON_GPU = _v1_runner_seam("runner_counts_on_gpu", "accepted counts taken on the GPU")
RUNNER_GRAPHS_DISPATCHED = _v1_runner_seam(
    "runner_graphs_dispatched", "CUDA graph dispatcher built"
)
RUNNER_COPIES_SCHEDULER_OUTPUT = _v1_runner_seam(
    "runner_copies_scheduler_output", "private scheduler output"
)
RUNNER_CUT_DRAFTS = _v1_runner_seam("runner_cut_drafts", "scheduled drafts cut in `_update_states`")
RUNNER_DRAFT_COUNT = _v1_runner_seam("runner_draft_count", "drafts to propose")
RUNNER_DRAFTED = _v1_runner_seam("runner_drafted", "after the drafter")


def _never(settings: Any, mode: str) -> str | None:
    return None


@dataclass(frozen=True)
class Feature:
    name: str
    """Its module's name: engine/NAME.py."""
    seams: tuple[Seam, ...]
    """Where vLLM calls it: its module defines a function of each seam's name."""
    env: str
    """The environment variable the launcher sets and the engine reads."""
    knob: str
    """The Settings knob that switches it."""
    status: str
    """What it does and how far it is proven: engine/README.md's table."""
    launch: Callable[[Any, str], str | None] | None = None
    """(Settings, mode) -> the variable's value in `hyperqwen serve`'s environment, None: unset.
    None: an own on/off knob, the variable set to 1 when the knob is."""
    unset: str = OFF
    """What the engine runs with the variable unset."""
    owned_knob: Knob | None = None
    """The knob's declaration, where the feature owns it; None: a knob Settings declares."""
    changes_compiled_graph: bool = True
    """Whether it may change what a torch.compile graph holds, so vLLM's compile cache key
    includes the variable (patches/compile-cache-key.patch) and a graph cached with the switch
    off is not loaded with it on. True unless shown otherwise: w4a16_linear and gdn_ba decide
    at layer construction which ops the graph calls; the runtime switches stay in the key as
    they always were, none being shown to leave every compiled graph alone."""
    ignored: Callable[[Any, str], str | None] = _never
    """(Settings, mode) -> why the knob, set explicitly, has no effect there (a launch warning)."""
    turned_on_by: str = ""
    """KNOB=VALUE that turns it on, where the knob is not its own."""

    def env_for(self, settings: Any, mode: str) -> str | None:
        """The variable's value in `hyperqwen serve MODE`'s environment; None: unset."""
        if self.launch is None:
            return ON if getattr(settings, self.knob) == ON else None
        return self.launch(settings, mode)

    @property
    def module(self) -> str:
        """Where its code is, relative to src/hyperqwen."""
        return f"engine/{self.name}.py"

    @property
    def modes(self) -> tuple[str, ...]:
        """The modes whose servers may run it: its own knob's, else both."""
        return self.owned_knob.modes if self.owned_knob else BOTH_MODES

    @property
    def ablation(self) -> str:
        """KNOB=VALUE that runs it the other way from the shipped default (a `bench ab` variant)."""
        if self.owned_knob is None:
            return self.turned_on_by
        flipped = next(v for v in self.owned_knob.values if v != self.owned_knob.default)
        return f"{self.knob}={flipped}"

    @property
    def values(self) -> tuple[str, ...]:
        """The values the variable may hold: the owned knob's, else a switch's 0 and 1."""
        return self.owned_knob.values if self.owned_knob else SWITCH

    def state(self, value: str | None) -> str:
        """What the engine runs with the variable at `value` (None: unset); a value it does not
        take is refused by name."""
        value = self.unset if value is None else value
        if value not in self.values:
            raise FeatureSwitchError(
                f"{self.env}={value!r}: expected one of {', '.join(self.values)} (the launcher "
                f"sets it from the {self.knob} knob; unset means {self.unset})"
            )
        return value


def env_value(feature: Feature) -> str:
    """The feature's variable in this (vLLM's) process, unset read as the feature's default."""
    return feature.state(os.environ.get(feature.env))


def switched_on(feature: Feature) -> bool:
    """Whether seams.py calls the feature: any value but 0 or off (draft_vocab's auto too)."""
    return env_value(feature) not in (OFF, "off")


def _lookup_ignored(settings: Any, mode: str) -> str | None:
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
        return ON
    if settings.SPEC == "mtp" and settings.LOOKUP != OFF:
        return settings.LOOKUP
    return None


GDN_RECURRENT = Feature(
    name="gdn_recurrent",
    seams=(GDN_MODULE_LOADED,),
    env="HYPERQWEN_GDN_RECURRENT",
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
    "CPU-tested (the patched module binds it, results match vLLM's kernel); speed not measured",
)

GDN_BA = Feature(
    name="gdn_ba",
    seams=(GDN_LAYER_BUILT,),
    env="HYPERQWEN_GDN_BA",
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
    "against float64, op against vLLM's path, `torch.library.opcheck`); not run on a GPU yet",
)

SPLIT_QKV = Feature(
    name="split_qkv",
    seams=(GDN_MIXED_QKV,),
    env="HYPERQWEN_GDN_SPLIT_QKV",
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

W4A16_LINEAR = Feature(
    name="w4a16_linear",
    seams=(LINEAR_KERNELS,),
    env="HYPERQWEN_W4A16",
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

DRAFT_VOCAB = Feature(
    name="draft_vocab",
    seams=(PROPOSER_LOADED,),
    env="HYPERQWEN_DRAFT_VOCAB",
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
    knob="LOOKUP",
    owned_knob=Knob(
        OFF,
        "Quoting: with SPEC=mtp and DRAFT_SAMPLE=greedy, also copy drafts from the request's "
        "own context (the tokens that followed the longest, latest earlier occurrence of its "
        "last 2-12 tokens) into MTP's draft slots, where the match is 6 tokens or more or MTP's "
        "first draft agrees. auto: on wherever it applies (single mode, MTP, greedy drafts), "
        "silently off elsewhere; 1: the same, with a warning where it cannot apply; 0: off. "
        "DRAFT_TOKENS above 3 lets a long match fill that many slots while other requests "
        "verify MTP's 3 (src/hyperqwen/engine/quoting.md; costs GDN state memory, not run on a "
        "GPU yet). Acceptance not measured: off by default until measured.",
        values=("auto", OFF, ON),
        modes=SINGLE_MODE,
    ),
    launch=_lookup_launch,
    ignored=_lookup_ignored,
    status="off (on with SPEC=lookup, or LOOKUP=auto/1 with SPEC=mtp); CPU-tested; on its first "
    "home, vLLM's async `ngram_gpu` proposer, SPEC=lookup drafted at 0.47x stock CPU n-gram's "
    "tokens/s on copy prompts (H200, SmolLM2-135M, 2026-12-01), so it moved to the CPU proposer "
    "(measured there with 3 requests per C1 row, too few to decide: single-user/README.md); "
    "LOOKUP=auto/1 (greedy MTP drafts) puts copies in MTP's slots and keeps vLLM's `ngram_gpu` "
    "bookkeeping of the token buffer, acceptance not measured; with DRAFT_TOKENS > 3 the "
    "per-request verify width of `quoting.py` (`quoting.md`: steps without a match keep their "
    "full CUDA graphs, each slot holds a GDN state per request, see `hyperqwen capacity`), "
    "CPU-tested, not run on a GPU yet; `hyperqwen bench quoting` (bench/README.md) measures it",
)

KVARN = Feature(
    name="kvarn",
    seams=(ATTENTION_KV_SPEC,),
    env="HYPERQWEN_KV_KVARN",
    knob="KV",
    turned_on_by="KV=kvarn",
    launch=lambda settings, mode: ON if settings.KV == "kvarn" else None,
    status="off (on with KV=kvarn); the vLLM plugin registers `../kvarn/backend.py` under "
    "vLLM's CUSTOM attention backend and the launcher selects it for the full-attention "
    "layers: 4-bit K / 2-bit V tiles of 128 tokens in uint8 pages (this seam sizes them), the "
    "sink and filling tiles in a 16-bit side cache that is, for now, a full 16-bit copy outside "
    "vLLM's budget (so no memory saved yet, KV_MEM required); decode by the fused Triton kernel, "
    "prefill in torch over dequantized tiles, no CUDA graphs for attention, no speculation; "
    "CPU-tested (`tests/test_kvarn_backend.py`, `tests/test_engine_kvarn.py`); the greedy GPU "
    "test (`tests/test_kvarn_serve_gpu.py`) not run",
)

# In this order: Settings adds the owned knobs, the launcher sets the variables and warns.
FEATURES: tuple[Feature, ...] = (
    GDN_RECURRENT,
    GDN_BA,
    SPLIT_QKV,
    W4A16_LINEAR,
    DRAFT_VOCAB,
    ALIGN_OVERLAP,
    LOOKUP,
    KVARN,
)


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

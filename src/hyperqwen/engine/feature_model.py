"""The shapes of HyperQwen's engine features (engine/features.py declares each one): a
feature's knob, the seams of vLLM it hooks, the declaration itself, and how vLLM's process
reads a feature's variable.

This module runs inside vLLM: it imports the standard library only.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

ON, OFF = "1", "0"
V2_RUNNER = "v2"  # MODEL_RUNNER's value for vLLM's V2 model runner (settings.py)
SWITCH = (OFF, ON)
BOTH_MODES = ("single", "batch")
SINGLE_MODE = ("single",)
BATCH_MODE = ("batch",)


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
    becomes: str = ""
    """What it becomes in `hyperqwen serve` (the docs' "becomes" column); empty: the feature's
    variable."""


@dataclass(frozen=True)
class Seam:
    """A place in vLLM with no extension point, where a patch calls seams.NAME."""

    name: str
    """The function of engine/seams.py the hook calls, and of each feature module on it."""
    patch: str
    where: str
    """Where in vLLM, in words (engine/README.md's table)."""
    v1_runner: bool = False
    """Whether only vLLM's V1 model runner reaches it: with MODEL_RUNNER=v2 nothing calls it."""


GDN_MODULE_LOADED = Seam("gdn_module_loaded", "gdn-layer.patch", "the GDN layer module loads")
GDN_LAYER_BUILT = Seam("gdn_layer_built", "gdn-layer.patch", "a GDN layer is built")
GDN_MIXED_QKV = Seam("gdn_mixed_qkv", "gdn-layer.patch", "the GDN layer's `rearrange_mixed_qkv`")
GDN_STEP_BEGINS = Seam(
    "gdn_step_begins", "gdn-layer.patch", "the GDN layer's step, before any kernel reads a state"
)
GDN_VERIFY = Seam(
    "gdn_verify", "gdn-layer.patch", "the GDN layer's recurrent step, before vLLM's verify kernel"
)
LINEAR_KERNELS = Seam(
    "linear_kernels", "linear-kernels.patch", "vLLM's choice of mixed-precision linear kernel"
)
PROPOSER_LOADED = Seam(
    "proposer_loaded", "proposer-loaded.patch", "a speculative proposer's model is loaded, V1/V2"
)
# vLLM 0.26's V2 runner has no n-gram drafting
NGRAM_DRAFTS = Seam(
    "ngram_drafts", "ngram-drafts.patch", "V1 runner: vLLM's CPU n-gram proposer", v1_runner=True
)
ATTENTION_KV_SPEC = Seam(
    "attention_kv_spec",
    "attention-kv-spec.patch",
    "an attention layer's KV cache spec, and the hybrid page alignment's bytes per token",
)

SCHEDULER_MAMBA_SPLIT = Seam(
    "scheduler_mamba_split", "scheduler-split.patch", "the scheduler's mamba `align` chunk split"
)
COMPILE_CACHE_INITIALIZED = Seam(
    "compile_cache_initialized",
    "compile-cache-dirs.patch",
    "the end of vLLM's Inductor adaptors' `initialize_cache`, compile cache on",
)


def _v1_runner_seam(name: str, where: str) -> Seam:
    """A seam of the V1 runner (v1-runner.patch)."""
    return Seam(name, "v1-runner.patch", f"V1 runner: {where}", v1_runner=True)


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
RUNNER_ALIGN_COPIES = _v1_runner_seam(
    "runner_align_copies", "the layers' state lists an `align` state copy sees"
)
RUNNER_ALIGN_COPIED = _v1_runner_seam("runner_align_copied", "after an `align` state copy")


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
    more_knobs: tuple[tuple[str, Knob], ...] = ()
    """(NAME, declaration) of the knobs it owns besides its switch: Settings adds each as a
    field; they shape how it runs, read by `launch` (and `ignored`) only."""
    more_values: tuple[str, ...] = ()
    """Values its variable takes that its knob does not: `launch` sets them from more_knobs."""
    changes_compiled_graph: bool = True
    """Whether it may change what a torch.compile graph holds, so vLLM's compile cache key
    includes the variable (patches/compile-cache-key.patch) and a graph cached with the switch
    off is not loaded with it on. True unless shown otherwise: a feature that decides at layer
    construction which ops the graph calls changes it; the runtime switches stay in the key as
    they always were, none being shown to leave every compiled graph alone."""
    ignored: Callable[[Any, str], str | None] = _never
    """(Settings, mode) -> why the knob, set explicitly, has no effect there (a launch warning)."""
    refusal: Callable[[Any, str], str | None] = _never
    """(Settings, mode) -> why `hyperqwen serve MODE` must not start with these settings (a
    combination the feature, switched on, does not support yet), asked before vLLM starts."""
    turned_on_by: str = ""
    """KNOB=VALUE that turns it on, where the knob is not its own."""
    own_files: tuple[str, ...] = ()
    """Files besides its module that exist only for it (they go with it), relative to the
    repository root: its kernels, parts, notes, the benchmark of it. They may name it; any
    other file that does is a place tests/test_engine_feature_places.py counts."""
    prepare_step: str = ""
    """Where it needs files in the model folder: the module of its `hyperqwen prepare` step,
    named after the feature (TITLE, MODEL_FILES, `plan`, `write`, `loads_model_files`,
    `served_bytes`; prepare/run.py runs it, the capacity budget counts what the server holds
    for the files it loads)."""

    cards: str = ""
    """Which path each GPU architecture takes with it on, where that differs by card
    (kernels/README.md's generated table); empty: every card the same."""
    registers: bool = False
    """Whether its module's `register()` puts its part into one of vLLM's registries (an
    attention backend, a quantization config): the vLLM plugin (../vllm_plugin.py) calls it in
    each vLLM process while the feature is switched on."""
    one_gdn_state_per_request: bool = False
    """Whether, switched on with speculation, a request keeps one GDN state block (two under
    prefix caching's `align` mode) instead of one per draft, its page holding the last
    verify's k, v, a and b too: the capacity budget sizes the pool so (capacity.py)."""
    checked_at_serve: bool = False
    """Whether `hyperqwen serve` asks its module's `serve_refusal(value, gpus, model_dir)`,
    before vLLM starts, why the variable's value cannot serve on these GPUs (hyperqwen.gpu.Gpu)
    and this model folder (None: it can). Only a feature whose variable is set is asked."""
    kvarn_value_bits: bool = False
    """Whether its variable's value (unset: its `unset`) is the bits of each value in KV=kvarn's
    tiles: the capacity budget sizes KVarN's pages with it (capacity.py, through the launcher's
    cache setup), as the backend does its pool."""

    @property
    def needs_v1_runner(self) -> bool:
        """Whether a seam of it lies where only vLLM's V1 model runner goes."""
        return any(seam.v1_runner for seam in self.seams)

    def env_for(self, settings: Any, mode: str) -> str | None:
        """The variable's value in `hyperqwen serve MODE`'s environment; None: unset (a
        feature the V1 runner alone calls stays unset under MODEL_RUNNER=v2)."""
        if self.needs_v1_runner and getattr(settings, "MODEL_RUNNER", None) == V2_RUNNER:
            return None
        if self.launch is None:
            return ON if getattr(settings, self.knob) == ON else None
        return self.launch(settings, mode)

    @property
    def module(self) -> str:
        """Where its code is, relative to src/hyperqwen."""
        return f"engine/{self.name}.py"

    def code(self) -> ModuleType:
        """Its module, imported (seams.py calls into it; so may a benchmark of the seam)."""
        return importlib.import_module(f"hyperqwen.engine.{self.name}")

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
        """The values the variable may hold: the owned knob's (else a switch's 0 and 1), then
        more_values."""
        return (self.owned_knob.values if self.owned_knob else SWITCH) + self.more_values

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
    """Whether seams.py calls the feature: any value but 0 or off (auto too)."""
    return env_value(feature) not in (OFF, "off")

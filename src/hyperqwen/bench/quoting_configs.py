"""`bench quoting`'s server configurations: what each one serves with, and its baseline.

vLLM's side is the competitor a user has: stock vLLM (--stock-vllm) with its defaults, without
speculation (`vllm-off`), and with its own n-gram proposers, `ngram` (CPU) and `ngram_gpu`, at
k = 4, 8 and 15 drafts, each matching the project's SPEC=ngram n-gram lengths. HyperQwen's side
is the project's profile (`hyperqwen serve single`, --patched-vllm) with the lookup knobs
(--lookup-knobs; default SPEC=lookup DRAFT_TOKENS=15), the same drafting on the GPU
(`lookup-gpu`: those knobs and LOOKUP_DEVICE=gpu, vLLM's ngram_gpu path with async scheduling),
the same drafting proposing every step (`lookup-fill`: those knobs and LOOKUP_FILL=1: one verify
width, full CUDA graphs for every decode step; LOOKUP_FILL's default, auto, does the same) and only
on a match (`lookup-nofill`: LOOKUP_FILL=0), the same profile with vLLM's own n-gram search
(`hyperqwen-ngram`: SPEC=ngram with the lookup knobs' DRAFT_TOKENS, so lookup's search and
policy against vLLM's on one build and its flags), and the same profile with SPEC=off
(`hyperqwen-off`). Each configuration names the one whose greedy text it must equal: the same
build without speculation (hyperqwen-off's is vllm-off: what the build alone changes).
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from hyperqwen.bench.ab_argv import (
    compact,
    profile_launch,
    server_environment,
    stock_serve_argv,
)
from hyperqwen.bench.ab_plan import ABError
from hyperqwen.launch import NGRAM_MATCH
from hyperqwen.settings import knobs

VLLM_BASELINE = "vllm-off"
HYPERQWEN_BASELINE = "hyperqwen-off"
LOOKUP = "lookup"
LOOKUP_GPU = "lookup-gpu"
LOOKUP_FILL = "lookup-fill"
LOOKUP_NOFILL = "lookup-nofill"
HYPERQWEN_NGRAM = "hyperqwen-ngram"
LOOKUP_CONFIGS = (LOOKUP, LOOKUP_GPU, LOOKUP_FILL, LOOKUP_NOFILL)
NGRAM_METHODS = ("ngram", "ngram_gpu")
NGRAM_DRAFTS = (4, 8, 15)
DEFAULT_LOOKUP_KNOBS = "SPEC=lookup DRAFT_TOKENS=15"
# Knobs of the lookup server that speculation alone uses: its baseline leaves them out.
SPECULATION_KNOBS = (
    "SPEC",
    "DRAFT_TOKENS",
    "DRAFT_SAMPLE",
    "LOOKUP",
    "LOOKUP_DEVICE",
    "LOOKUP_FILL",
)


@dataclass(frozen=True)
class ServerConfig:
    name: str
    build: str
    """vllm (stock, --stock-vllm) or hyperqwen (the profile, --patched-vllm)."""
    baseline: str | None
    """The configuration whose greedy answers this one's must equal (None: the reference)."""
    speculative_config: dict | None = None
    """vLLM's --speculative-config (build vllm)."""
    knob_values: dict[str, str] = field(default_factory=dict)
    """The profile's knobs over the environment's (build hyperqwen)."""
    own_vllm_args: str = ""
    """vLLM flags of this configuration alone, after the run's (`bench quoting --config-args`)."""

    @property
    def ngram_method(self) -> str | None:
        """ngram or ngram_gpu for vLLM's n-gram configurations, else None."""
        method = (self.speculative_config or {}).get("method")
        return method if method in NGRAM_METHODS else None

    def serve(
        self, model: Path, port: int, vllm_args: str, env_file: str | None, parent: Path
    ) -> tuple[list[str], dict[str, str]]:
        """The `vllm serve ...` arguments and the environment of this configuration's server,
        with parent's vllm/ first on PYTHONPATH."""
        vllm_args = " ".join(filter(None, [vllm_args, self.own_vllm_args]))
        extra = shlex.split(vllm_args)
        if self.build == "vllm":
            spec = self.speculative_config
            flags = ["--speculative-config", compact(spec)] if spec else []
            return [*stock_serve_argv(model, port), *flags, *extra], server_environment(parent)
        launch = profile_launch(model, port, "single", env_file, self.knob_values, vllm_args)
        return [*launch.argv[1:], *extra], server_environment(parent, launch.env)


def parse_knobs(text: str, option: str = "--lookup-knobs") -> dict[str, str]:
    """'SPEC=lookup DRAFT_TOKENS=15' -> {"SPEC": "lookup", ...}; a word that is not NAME=VALUE
    or a name that is no knob is refused by name (the values are the profile's to check)."""
    names = {info.name for info in knobs()}
    values = {}
    for word in shlex.split(text):
        name, equals, value = word.partition("=")
        if not equals or name not in names:
            raise ABError(
                f"{option} {word!r}: give knobs as NAME=VALUE words, NAME one of the project's "
                "knobs (single-user/README.md lists them), e.g. "
                f"{option}='{DEFAULT_LOOKUP_KNOBS}'"
            )
        values[name] = value
    return values


def catalogue(lookup_knobs: dict[str, str]) -> dict[str, ServerConfig]:
    """Every configuration, in the order a full run serves them: the references first."""
    configs = [ServerConfig(VLLM_BASELINE, "vllm", None)]
    for method in NGRAM_METHODS:
        for drafts in NGRAM_DRAFTS:
            spec = {
                "method": method,
                "num_speculative_tokens": drafts,
                "prompt_lookup_min": NGRAM_MATCH[0],
                "prompt_lookup_max": NGRAM_MATCH[1],
            }
            configs.append(ServerConfig(f"{method}-k{drafts}", "vllm", VLLM_BASELINE, spec))
    off = {name: value for name, value in lookup_knobs.items() if name not in SPECULATION_KNOBS}
    configs.append(
        ServerConfig(
            HYPERQWEN_BASELINE, "hyperqwen", VLLM_BASELINE, knob_values={**off, "SPEC": "off"}
        )
    )
    configs.append(ServerConfig(LOOKUP, "hyperqwen", HYPERQWEN_BASELINE, knob_values=lookup_knobs))
    on_gpu = {**lookup_knobs, "LOOKUP_DEVICE": "gpu"}
    configs.append(ServerConfig(LOOKUP_GPU, "hyperqwen", HYPERQWEN_BASELINE, knob_values=on_gpu))
    filled = {**lookup_knobs, "LOOKUP_FILL": "1"}
    configs.append(ServerConfig(LOOKUP_FILL, "hyperqwen", HYPERQWEN_BASELINE, knob_values=filled))
    unfilled = {**lookup_knobs, "LOOKUP_FILL": "0"}
    configs.append(
        ServerConfig(LOOKUP_NOFILL, "hyperqwen", HYPERQWEN_BASELINE, knob_values=unfilled)
    )
    vllms_search = {**off, "SPEC": "ngram"}
    if "DRAFT_TOKENS" in lookup_knobs:
        vllms_search["DRAFT_TOKENS"] = lookup_knobs["DRAFT_TOKENS"]
    configs.append(
        ServerConfig(HYPERQWEN_NGRAM, "hyperqwen", HYPERQWEN_BASELINE, knob_values=vllms_search)
    )
    return {config.name: config for config in configs}


def with_own_args(
    configs: dict[str, ServerConfig], given: Sequence[tuple[str, str]], started: set[str]
) -> dict[str, ServerConfig]:
    """The catalogue with --config-args NAME=FLAGS applied: each named configuration started
    here gets its own vLLM flags (one option per name); anything else is refused by name."""
    own: dict[str, str] = {}
    for name, flags in given:
        if name not in configs:
            raise ABError(
                f"--config-args {name}=...: no such configuration; name one of {', '.join(configs)}"
            )
        if name not in started:
            raise ABError(
                f"--config-args {name}=...: {name} is not started by this run (it is not in "
                "--configs, or --url gives its server): its flags would change nothing"
            )
        if name in own:
            raise ABError(f"--config-args {name}=... is given twice: give its flags in one")
        try:
            shlex.split(flags)
        except ValueError as error:
            raise ABError(f"--config-args {name}={flags!r} cannot be read: {error}") from None
        own[name] = flags
    return {
        name: replace(config, own_vllm_args=own[name]) if name in own else config
        for name, config in configs.items()
    }


def chosen(names: str, configs: dict[str, ServerConfig]) -> list[ServerConfig]:
    """--configs LIST ('all' or names, comma separated) as configurations, in the catalogue's
    order; an unknown name is refused by name."""
    if names.strip() == "all":
        return list(configs.values())
    wanted = [name.strip() for name in names.split(",") if name.strip()]
    if unknown := [name for name in wanted if name not in configs]:
        raise ABError(
            f"--configs {unknown[0]}: no such configuration; give 'all' or some of "
            f"{', '.join(configs)}"
        )
    return [config for name, config in configs.items() if name in wanted]

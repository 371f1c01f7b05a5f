"""Settings -> (argv, env) for `vllm serve`: a pure function every launcher calls.

`build_launch` reads nothing from disk and starts nothing, so tests (and `--print-argv`) see
exactly what a server would run. The shell launchers in single-user/ and batch/, the systemd
units and the container entrypoint all end in `hyperqwen serve MODE`, which calls it.
"""

from __future__ import annotations

import ipaddress
import json
import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path

from hyperqwen.capacity import KVARN_DEFAULT_VALUE_BITS, CacheSetup, Machine
from hyperqwen.capacity_fit import (
    CapacityRefusal,
    ContextFit,
    fit_batch_to_card,
    fit_in_fewer_step_tokens,
    fit_to_card,
)
from hyperqwen.engine.features import (
    FEATURES,
    LOOKUP_ON_GPU,
    MTP_DRAFTS,
    OFF,
    ON,
    OUR_LINEAR_BACKEND,
    V2_RUNNER,
    draft_width_refusal,
    launch_env,
    serve_refusal as feature_refusal,
)
from hyperqwen.gpu import cards_below
from hyperqwen.kv_choices import KV_CHOICES, KVARN_CHOICE, capability_refusal, speculation_refusal
from hyperqwen.settings import (
    NO_REASONING_PARSER,
    LoadedSettings,
    Mode,
    Settings,
    SettingsError,
    knobs,
)
from hyperqwen.vllm_flags import flag_name


@dataclass(frozen=True)
class Profile:
    """Defaults a mode (and, in single mode, CTX) gives the knobs the user left unset."""

    max_len: int
    max_seqs: int
    kv_cache_dtype: str
    max_batched_tokens: int
    # GDN recurrent state. float32 is what Qwen3.5's config asks for (mamba_ssm_dtype); it is
    # ~150 MB per sequence at the 27B geometry, so batch mode halves it to fit 64 slots.
    ssm_cache_dtype: str
    # W4A16 GEMM kernel: Marlin beats vLLM's Hopper default Machete at the 4-16 rows of a
    # speculative decode step, Machete wins at 64 (docs/benchmarks.md, kernel and bench ab runs).
    linear_backend: str
    # GPU_COUNT > 1: one sharded server (tp) or a replica per GPU (dp).
    gpu_split: str


SINGLE_PROFILES: dict[str, Profile] = {
    "fast": Profile(65536, 4, "auto", 8192, "float32", "marlin", "tp"),
    "long": Profile(131072, 4, "fp8", 8192, "float32", "marlin", "tp"),
    "huge": Profile(262144, 1, "fp8", 4096, "float32", "marlin", "tp"),
}
BATCH_PROFILE = Profile(150000, 64, "fp8", 8192, "bfloat16", "auto", "dp")
DEFAULT_DRAFT_TOKENS = {"mtp": MTP_DRAFTS, "ngram": 4, "lookup": 4}
# SPEC=ngram's match lengths: 2-5 token n-grams of the prompt, long enough to avoid spurious
# copies (vLLM's own default, 5-5, finds fewer)
NGRAM_MATCH = (2, 5)
# SPEC=lookup's match lengths: from 2 tokens (quoting-j's answers replayed with 2 drafted on
# 9-15 points more of the steps and projected 6-8 % faster on the 27B than with 3:
# src/hyperqwen/engine/quoting.md, "Lookup's match"), at most 12 compared (longer agreement says
# nothing more about what comes next).
LOOKUP_MATCH = (2, 12)
# The SPEC values vLLM drafts for with its n-gram proposers (V1 runner only; verify blocks of
# varying width)
NGRAM_SPECS = ("ngram", "lookup")


def profile_for(settings: Settings, mode: Mode) -> Profile:
    if mode == "single":
        return SINGLE_PROFILES[settings.CTX]
    return BATCH_PROFILE


def kv_cache_dtype(settings: Settings, profile: Profile) -> str:
    """KV, else the profile's dtype."""
    return settings.KV or profile.kv_cache_dtype


def ssm_cache_dtype(settings: Settings, profile: Profile) -> str:
    """STATE_DTYPE, where it is not auto, else the profile's dtype."""
    return profile.ssm_cache_dtype if settings.STATE_DTYPE == "auto" else settings.STATE_DTYPE


class KvRefusal(SettingsError):
    """A KV choice that cannot serve with the other knobs; the message names both and the fix."""


class DraftWidthRefusal(SettingsError):
    """DRAFT_TOKENS wider than the drafting path takes; the message names the knob and the fix."""


class RunnerRefusal(SettingsError):
    """MODEL_RUNNER=v2 with a knob that needs vLLM's V1 runner; the message names both."""


# MODEL_RUNNER -> vLLM's VLLM_USE_V2_MODEL_RUNNER (auto: unset, vLLM's choice)
RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"
RUNNER_ENV_VALUES = {"v1": "0", V2_RUNNER: "1"}


def model_runner(settings: Settings, mode: Mode, explicit: frozenset[str]) -> list[str]:
    """MODEL_RUNNER=v2's notices: the engine features the V1 runner alone calls, which
    would run by default here and stay off. Raises RunnerRefusal where a knob set to turn on
    such a feature, or a SPEC only the V1 runner drafts with, meets it."""
    if settings.MODEL_RUNNER != V2_RUNNER:
        return []
    if mode == "single" and settings.SPEC in NGRAM_SPECS:
        raise RunnerRefusal(
            f"SPEC={settings.SPEC} needs vLLM's V1 model runner (vLLM 0.26's V2 runner has no "
            "n-gram drafting): set MODEL_RUNNER=auto, or SPEC=mtp or off."
        )
    as_v1 = settings.model_copy(update={"MODEL_RUNNER": "v1"})
    dropped = []
    for feature in FEATURES:
        if not feature.needs_v1_runner or feature.env_for(as_v1, mode) in (None, OFF):
            continue
        if feature.knob in explicit and getattr(settings, feature.knob) == ON:
            raise RunnerRefusal(
                f"{feature.knob}=1 needs vLLM's V1 model runner ({feature.name} is called from "
                "its seams in the V1 runner, which MODEL_RUNNER=v2 does not run): set "
                f"{feature.knob}=0, or MODEL_RUNNER=auto."
            )
        dropped.append(feature.name)
    if not dropped:
        return []
    return [f"MODEL_RUNNER=v2: {', '.join(dropped)} stay off (vLLM's V1 runner alone calls them)."]


@dataclass(frozen=True)
class LaunchPlan:
    argv: list[str]
    env: dict[str, str]
    """Variables to add to the inherited environment (the API key travels here, not in argv)."""
    warnings: list[str] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    model_path: Path = Path()
    served_name: str = ""
    tensor_parallel: int = 1
    # MAX_LEN, MAX_SEQS and tokens a step as launched; its line says what the card holds
    # ("" where the launch was not sized to a card)
    fit: ContextFit = field(kw_only=True)


def is_loopback(address: str) -> bool:
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def model_path(settings: Settings) -> Path:
    """MODEL is a folder name inside MODELS_DIR, or a path when it contains a slash."""
    if "/" in settings.MODEL:
        return Path(settings.MODEL)
    return settings.MODELS_DIR / settings.MODEL


def speculative_config(settings: Settings, kv: str | None = None) -> dict | None:
    """vLLM's --speculative-config for SPEC; `kv` (the KV choice) names the MTP drafter's
    attention backend where the choice needs one (kv_choices.KvChoice.drafter_backend)."""
    if settings.SPEC == "off":
        return None
    config: dict = {
        "method": settings.SPEC,
        "num_speculative_tokens": settings.DRAFT_TOKENS or DEFAULT_DRAFT_TOKENS[settings.SPEC],
    }
    if settings.SPEC == "ngram":
        config.update(prompt_lookup_min=NGRAM_MATCH[0], prompt_lookup_max=NGRAM_MATCH[1])
    elif settings.SPEC == "lookup":
        # vLLM's CPU n-gram proposer, or its GPU one (async scheduling on), searching with
        # HyperQwen's match (an engine feature)
        method = "ngram_gpu" if settings.LOOKUP_DEVICE == LOOKUP_ON_GPU else "ngram"
        config.update(
            method=method, prompt_lookup_min=LOOKUP_MATCH[0], prompt_lookup_max=LOOKUP_MATCH[1]
        )
    else:
        config["draft_sample_method"] = settings.DRAFT_SAMPLE
        drafter_backend = KV_CHOICES[kv].drafter_backend if kv else None
        if drafter_backend:
            config["attention_backend"] = drafter_backend
    return config


# Single mode captures CUDA graphs up to this many tokens per step, as stock vLLM does
# (min(2 x max_num_seqs, 512) with its larger max_num_seqs): a chat turn's prompt of up to 512
# tokens then prefills in piecewise graphs instead of launching every kernel of 64 layers.
PREFILL_GRAPH_TOKENS = 512


# torch Inductor's config key for programmatic dependent launch in the Triton kernels it
# generates (torch/_inductor/config.py, class triton: enable_pdl), which it emits from sm90 on
INDUCTOR_PDL_KEY = "triton.enable_pdl"
INDUCTOR_PDL_MIN_CAPABILITY = (9, 0)


def inductor_pdl_refusal(settings: Settings, gpus: list) -> str | None:
    """Why INDUCTOR_PDL=1 cannot take effect on these GPUs (hyperqwen.gpu.Gpu), or None:
    below sm90 Inductor would leave it out without a word, so 1 is refused there by name."""
    if settings.INDUCTOR_PDL != ON:
        return None
    short = cards_below(gpus, INDUCTOR_PDL_MIN_CAPABILITY)
    if not short:
        return None
    return (
        "INDUCTOR_PDL=1 needs compute capability 9.0 or newer (H100/H200, RTX 5090), where "
        f"torch Inductor emits programmatic dependent launch; this machine has "
        f"{', '.join(short)}. Set INDUCTOR_PDL=0."
    )


def start_refusal(settings: Settings, mode: str, gpus: list) -> str | None:
    """Why `hyperqwen serve MODE` must not start with these settings on these GPUs (the ones
    it serves on: hyperqwen.gpu.Gpu) and this model folder, or None: a KV cache the cards
    cannot store, INDUCTOR_PDL below sm90, and each engine feature's own refusals.
    `hyperqwen doctor` asks the same."""
    kv = settings.KV
    return (
        (kv and capability_refusal(kv, gpus))
        or inductor_pdl_refusal(settings, gpus)
        or feature_refusal(settings, mode, gpus, model_path(settings))
    )


def compilation_config(max_graph_tokens: int, inductor_pdl: bool = False) -> dict:
    # Full CUDA graphs for decode-only batches (GDN layers need them to be fast), piecewise for
    # mixed ones, up to max_graph_tokens tokens per step; larger steps (long prefills, which
    # are compute-bound) run without graphs. Not FULL for every step: served that way on the
    # H100, vLLM 0.26 without speculation (stock too) answered otherwise from the first token,
    # and n-gram drafting's verify blocks of varying width did without
    # patches/full-graph-mixed-query-len.patch (src/hyperqwen/engine/quoting.md, "Lookup alone").
    config: dict = {
        "cudagraph_mode": "FULL_AND_PIECEWISE",
        "max_cudagraph_capture_size": max_graph_tokens,
    }
    if inductor_pdl:
        # part of vLLM's compilation config, so of its compile cache key
        config["inductor_compile_config"] = {INDUCTOR_PDL_KEY: True}
    return config


def vllm_linear_backend(backend: str) -> str:
    """What --linear-backend gets: hyperqwen is Marlin for the layers HyperQwen's kernel
    leaves (the engine feature it switches on)."""
    return "marlin" if backend == OUR_LINEAR_BACKEND else backend


def cache_setup(
    settings: Settings,
    profile: Profile,
    machine: Machine,
    tensor_parallel: int = 1,
    mode: Mode = "single",
) -> CacheSetup:
    """The launch choices that shape vLLM's KV-cache pool (capacity.py); batch mode drafts
    nothing."""
    spec = speculative_config(settings) if mode == "single" else None
    replay = any(
        feature.one_gdn_state_per_request and feature.env_for(settings, mode) == ON
        for feature in FEATURES
    )
    # KVarN's value bits as KV=kvarn serves them, whatever KV is: `hyperqwen capacity` sizes
    # kvarn beside the chosen cache
    as_kvarn = settings.model_copy(update={"KV": KVARN_CHOICE})
    v_bits = next(
        (int(f.state(f.env_for(as_kvarn, mode))) for f in FEATURES if f.kvarn_value_bits),
        KVARN_DEFAULT_VALUE_BITS,
    )
    return CacheSetup(
        kv_cache_dtype(settings, profile),
        ssm_cache_dtype(settings, profile),
        draft_tokens=spec["num_speculative_tokens"] if spec else 0,
        mtp_layers=machine.geometry.mtp_num_hidden_layers if spec and settings.SPEC == "mtp" else 0,
        prefix_caching=settings.PREFIX_CACHE == "1",
        tensor_parallel=tensor_parallel,
        replay=replay,
        v_bits=v_bits,
    )


def fitted_context(
    settings: Settings,
    mode: Mode,
    profile: Profile,
    machine: Machine | str | None,
    tensor_parallel: int,
) -> tuple[ContextFit, list[str], list[str]]:
    """MAX_LEN, MAX_SEQS and tokens per step (its line the startup notice saying what the card
    holds, "" when not sized), with notices and warnings: the knobs, else the profile's
    numbers, shrunk to what the machine's card holds (capacity.py: a single-mode profile keeps
    every slot at full length, batch's slots share the pool; fewer tokens per step come
    before fewer slots or a shorter length). CapacityRefusal for knob values the
    card cannot hold; only a warning on an assumed card (no GPU seen) unless KV_MEM fixes the
    cache size whatever the card. `machine` is None when no budget is asked for, or the
    reason there can be none."""
    max_len = settings.MAX_LEN or profile.max_len
    max_seqs = settings.MAX_SEQS or profile.max_seqs
    unsized = ContextFit(max_len, max_seqs, "", profile.max_batched_tokens)
    if machine is None:
        return unsized, [], []
    name = f"CTX={settings.CTX}" if mode == "single" else "batch"
    if isinstance(machine, str):
        return unsized, [f"{name}: not sized to the card: {machine}."], []
    setup = cache_setup(settings, profile, machine, tensor_parallel, mode)
    target = (profile.max_len, profile.max_seqs)
    fit_to = fit_to_card if mode == "single" else fit_batch_to_card
    try:
        fit = fit_in_fewer_step_tokens(
            fit_to, machine, settings, setup, target, profile.max_batched_tokens
        )
    except CapacityRefusal as refusal:
        if settings.KV_MEM or not machine.card_assumed:
            raise
        return unsized, [], [f"{refusal} (the server checks its own card at start)"]
    line = f"{name}: {fit.line}"
    if fit.batched_tokens < profile.max_batched_tokens:
        line += (
            f" Steps of at most {fit.batched_tokens:,} tokens (--max-num-batched-tokens; the "
            f"profile's {profile.max_batched_tokens:,} leave less room: vLLM's profile run "
            "needs activations for a whole step)."
        )
    return replace(fit, line=line), [line], []


def build_launch(
    loaded: LoadedSettings,
    mode: Mode,
    api_key: str | None,
    in_container: bool = False,
    machine: Machine | str | None = None,
) -> LaunchPlan:
    """The argv and environment of `vllm serve` for these settings. Pure: no I/O.

    With a `machine` (card memory, model size), the profile's MAX_LEN and MAX_SEQS shrink to
    what its memory holds, and knob values that cannot fit raise CapacityRefusal."""
    settings = loaded.settings
    profile = profile_for(settings, mode)
    linear_backend = settings.LINEAR_BACKEND or profile.linear_backend
    warnings: list[str] = []

    host, host_warnings, notices = choose_host(settings, api_key, in_container, loaded.explicit)
    warnings += host_warnings
    path = model_path(settings)
    served_name = path.name
    kv_dtype = kv_cache_dtype(settings, profile)
    refusal = speculation_refusal(kv_dtype, settings.SPEC, settings.DRAFT_TOKENS)
    if mode == "single" and refusal:
        raise KvRefusal(refusal)
    width_refusal = draft_width_refusal(settings) if mode == "single" else None
    if width_refusal:
        raise DraftWidthRefusal(width_refusal)
    notices += model_runner(settings, mode, loaded.explicit)
    split = settings.GPU_SPLIT or profile.gpu_split
    tensor_parallel = settings.GPU_COUNT if split == "tp" else 1
    spec = speculative_config(settings, kv_dtype) if mode == "single" else None
    fit, fit_notices, fit_warnings = fitted_context(
        settings, mode, profile, machine, tensor_parallel
    )
    max_len, max_seqs = fit.max_len, fit.max_seqs
    notices += fit_notices
    warnings += fit_warnings

    # (flag, value or None, knob that decided it) — the knob names feed the shadow warning.
    flags: list[tuple[str, str | None, str]] = [
        ("--host", host, "HOST"),
        ("--port", str(settings.PORT), "PORT"),
        ("--served-model-name", served_name, "MODEL"),
        ("--max-model-len", str(max_len), "MAX_LEN"),
        ("--max-num-seqs", str(max_seqs), "MAX_SEQS"),
        (
            "--max-num-batched-tokens",
            str(fit.batched_tokens),
            "CTX" if mode == "single" else "mode batch",
        ),
        ("--gpu-memory-utilization", f"{settings.GPU_UTIL:g}", "GPU_UTIL"),
        ("--tensor-parallel-size", str(tensor_parallel), "GPU_COUNT"),
        (
            "--kv-cache-dtype",
            KV_CHOICES[kv_dtype].vllm_cache_dtype,
            "KV" if settings.KV or mode == "batch" else "CTX",
        ),
        *((flag, value, "KV") for flag, value in KV_CHOICES[kv_dtype].launch_flags()),
        (
            "--mamba-ssm-cache-dtype",
            ssm_cache_dtype(settings, profile),
            f"mode {mode}" if settings.STATE_DTYPE == "auto" else "STATE_DTYPE",
        ),
        ("--linear-backend", vllm_linear_backend(linear_backend), "LINEAR_BACKEND"),
        (
            "--enable-prefix-caching"
            if settings.PREFIX_CACHE == "1"
            else "--no-enable-prefix-caching",
            None,
            "PREFIX_CACHE",
        ),
        # Clients see how much of each prompt came from the prefix cache.
        ("--enable-prompt-tokens-details", None, "always"),
    ]
    if split == "dp" and settings.GPU_COUNT > 1:
        flags.append(("--data-parallel-size", str(settings.GPU_COUNT), "GPU_SPLIT"))
    if settings.KV_MEM:
        flags.append(("--kv-cache-memory-bytes", settings.KV_MEM, "KV_MEM"))
    if settings.VISION == "0":
        flags.append(("--language-model-only", None, "VISION"))
    if settings.TOOLS == "1":
        flags.append(("--enable-auto-tool-choice", None, "TOOLS"))
        flags.append(("--tool-call-parser", settings.TOOL_PARSER, "TOOL_PARSER"))
    if settings.REASONING_PARSER != NO_REASONING_PARSER:
        flags.append(("--reasoning-parser", settings.REASONING_PARSER, "REASONING_PARSER"))
    flags.append(("--sse-keep-alive-interval", f"{settings.SSE_KEEP_ALIVE:g}", "SSE_KEEP_ALIVE"))
    if settings.REQ_METRICS == "1":
        flags.append(("--enable-per-request-metrics", None, "REQ_METRICS"))

    tokens_per_step = max_seqs
    if spec:
        flags.append(("--speculative-config", json.dumps(spec, separators=(",", ":")), "SPEC"))
        tokens_per_step = max_seqs * (1 + spec["num_speculative_tokens"])
    # Batch mode: graphs for decode steps of up to max_seqs tokens only (graph memory goes to
    # KV cache; its prefills are batched and compute-bound).
    graph_tokens = max(tokens_per_step, PREFILL_GRAPH_TOKENS) if mode == "single" else max_seqs
    flags.append(
        (
            "--compilation-config",
            json.dumps(
                compilation_config(graph_tokens, settings.INDUCTOR_PDL == ON),
                separators=(",", ":"),
            ),
            f"mode {mode}",
        )
    )

    argv = ["vllm", "serve", str(path)]
    for flag, value, _ in flags:
        argv.append(flag)
        if value is not None:
            argv.append(value)

    extra = shlex.split(settings.EXTRA_ARGS)
    warnings += _shadow_warnings(extra, flags)
    argv += extra

    warnings += _ignored_knob_warnings(settings, mode, loaded.explicit)

    env = {"VLLM_API_KEY": api_key} if api_key else {}
    if settings.MODEL_RUNNER in RUNNER_ENV_VALUES:
        env[RUNNER_ENV] = RUNNER_ENV_VALUES[settings.MODEL_RUNNER]
    env.update(launch_env(settings, mode))
    return LaunchPlan(
        argv, env, warnings, notices, host, path, served_name, tensor_parallel, fit=fit
    )


def choose_host(
    settings: Settings,
    api_key: str | None,
    in_container: bool,
    explicit: frozenset[str],
) -> tuple[str, list[str], list[str]]:
    """The bind address, with warnings and notices about who can reach it."""
    warnings: list[str] = []
    notices: list[str] = []
    if in_container:
        # Inside the container only the published port is reachable; BIND decides exposure.
        host = settings.HOST or "0.0.0.0"
        if not api_key and not is_loopback(settings.BIND):
            warnings.append(
                f"BIND={settings.BIND} publishes the API beyond this machine WITHOUT an API key: "
                "anyone who can reach it can use it. Set VLLM_API_KEY (or api_key.txt), or "
                "BIND=127.0.0.1."
            )
        return host, warnings, notices
    if "HOST" in explicit and settings.HOST:
        if not api_key and not is_loopback(settings.HOST):
            warnings.append(
                f"HOST={settings.HOST} listens beyond this machine WITHOUT an API key: anyone "
                "who can reach the port can use it. Set VLLM_API_KEY (or api_key.txt), or "
                "unset HOST."
            )
        return settings.HOST, warnings, notices
    if api_key:
        notices.append("API key set: listening on all interfaces (0.0.0.0).")
        return "0.0.0.0", warnings, notices
    notices.append(
        "No API key: listening on 127.0.0.1 only. Set VLLM_API_KEY (or api_key.txt) to serve "
        "other machines."
    )
    return "127.0.0.1", warnings, notices


def _shadow_warnings(extra: list[str], flags: list[tuple[str, str | None, str]]) -> list[str]:
    set_by = {flag_name(flag): knob for flag, _, knob in flags}
    warnings = []
    for token in extra:
        name = flag_name(token)
        if name == "--api-key":
            warnings.append(
                "EXTRA_ARGS passes --api-key: the key then shows in process lists and logs. "
                "Use VLLM_API_KEY or api_key.txt instead."
            )
        elif name in set_by:
            warnings.append(
                f"EXTRA_ARGS sets {name}, which the launcher sets from {set_by[name]}; "
                "EXTRA_ARGS wins (it comes last)."
            )
    return warnings


def _ignored_knob_warnings(settings: Settings, mode: Mode, explicit: frozenset[str]) -> list[str]:
    warnings = []
    for info in knobs():
        if info.name in explicit and mode not in info.modes:
            warnings.append(
                f"{info.name} is a {'/'.join(info.modes)}-mode knob; ignored in {mode} mode."
            )
    if mode == "single" and settings.SPEC == "off":
        for name in ("DRAFT_TOKENS", "DRAFT_SAMPLE"):
            if name in explicit:
                warnings.append(f"{name} is ignored with SPEC=off.")
    if mode == "single" and settings.SPEC in NGRAM_SPECS and "DRAFT_SAMPLE" in explicit:
        warnings.append(
            f"DRAFT_SAMPLE is ignored with SPEC={settings.SPEC} (copied drafts are not sampled)."
        )
    for feature in FEATURES:
        owned = {feature.knob, *(name for name, _ in feature.more_knobs)}
        if owned & explicit and (why := feature.ignored(settings, mode)):
            warnings.append(why)
    if settings.TOOLS == "0" and "TOOL_PARSER" in explicit:
        warnings.append("TOOL_PARSER is ignored with TOOLS=0.")
    return warnings


REDACTED = "***"


def redact_argv(argv: list[str]) -> list[str]:
    """argv with any --api-key value hidden (only EXTRA_ARGS can put one there)."""
    shown, hide_next = [], False
    for token in argv:
        if hide_next:
            shown.append(REDACTED)
            hide_next = False
        elif flag_name(token) == "--api-key":
            hide_next = "=" not in token
            shown.append(token.split("=", 1)[0] + ("=" + REDACTED if "=" in token else ""))
        else:
            shown.append(token)
    return shown


def effective_config_lines(loaded: LoadedSettings, api_key: str | None) -> list[str]:
    """One line per knob, the key shown only as set(N chars)/unset."""
    lines = []
    for info in knobs():
        value = getattr(loaded.settings, info.name)
        if info.secret or info.name == "API_KEY_FILE":
            continue
        source = loaded.sources.get(info.name, "default")
        lines.append(f"  {info.name}={'' if value is None else value}  ({source})")
    key_state = f"set ({len(api_key)} chars)" if api_key else "unset"
    lines.append(f"  VLLM_API_KEY: {key_state}")
    return lines

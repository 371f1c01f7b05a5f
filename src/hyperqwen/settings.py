"""Every serving knob in one place: default, allowed values, help text and what it becomes.

The pydantic model below is the single source of truth (the knobs that switch an engine feature
are declared with the feature, in engine/features.py, and added to it from there). The launcher
(`launch.py`), the generated `.env.example`, the knob tables in `single-user/README.md` and
`batch/README.md` and the redacted startup print all read it; a test fails when the generated
files drift.

Knobs are read from the process environment and from a `.env` file (python-dotenv); the
environment wins. A knob left unset takes its profile default, which depends on the mode
(`single` or `batch`) and, in single mode, on `CTX`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from dotenv import dotenv_values
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator

from hyperqwen.engine.features import FEATURES, Knob
from hyperqwen.kv_choices import KvChoiceName

Mode = Literal["single", "batch"]
MODES: tuple[Mode, ...] = ("single", "batch")
BOTH: tuple[Mode, ...] = MODES
SINGLE: tuple[Mode, ...] = ("single",)

SpecMethod = Literal["mtp", "ngram", "lookup", "off"]
ContextProfile = Literal["fast", "long", "huge"]
DraftSample = Literal["greedy", "probabilistic"]
Switch = Literal["0", "1"]
# hyperqwen: engine.features.OUR_LINEAR_BACKEND (vLLM gets marlin)
LinearBackend = Literal["auto", "marlin", "machete", "hyperqwen"]
GpuSplit = Literal["tp", "dp"]
# vLLM 0.26's model runners: auto = vLLM's choice (V1 for this hybrid model)
ModelRunner = Literal["auto", "v1", "v2"]
# GDN recurrent-state dtypes vLLM 0.26 takes (config/cache.py: MambaDType, less its "auto" = the
# model dtype). Its GDN kernels load the state, update it in float32 and store it back in the
# cache's own dtype (FLA's fused_recurrent / chunk_delta_h, FlashInfer's prefill via a float32
# copy), so all three run.
StateDtype = Literal["float32", "bfloat16", "float16"]
# STATE_DTYPE's values; auto: the profile's dtype (not vLLM's auto, the model dtype)
StateDtypeKnob = Literal["auto", StateDtype]

PINNED_VLLM = "0.26.0"
DEFAULT_PORT = 18020


def knob(
    default: Any,
    help: str,
    becomes: str,
    modes: tuple[Mode, ...] = BOTH,
    secret: bool = False,
    **constraints: Any,
) -> Any:
    """A Field that also records which modes read it, what it becomes and whether it is secret."""
    return Field(
        default,
        description=help,
        json_schema_extra={"becomes": becomes, "modes": list(modes), "secret": secret},
        **constraints,
    )


# REASONING_PARSER value that leaves --reasoning-parser out.
NO_REASONING_PARSER = "none"


def _switched_by(name: str) -> str:
    """The variables of the engine features this Settings knob switches (features whose
    declaration names it as their knob without owning it)."""
    return ", ".join(f.env for f in FEATURES if f.knob == name and f.owned_knob is None)


class ServingKnobs(BaseModel):
    """The knobs Settings declares itself; the engine features' own knobs follow them, added
    from their declarations (engine/features.py) below."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    # --- network and access -------------------------------------------------------------
    PORT: int = knob(
        DEFAULT_PORT, "TCP port the OpenAI-compatible API listens on.", "--port", ge=1, le=65535
    )
    HOST: str | None = knob(
        None,
        "Address vLLM binds to. Unset: 127.0.0.1 without an API key, 0.0.0.0 with one "
        "(in the container: 0.0.0.0, exposure decided by BIND). Set it to override; a "
        "non-loopback HOST without a key starts with a loud warning.",
        "--host",
    )
    BIND: str = knob(
        "127.0.0.1",
        "Host address docker compose publishes the port on (compose only). Use 0.0.0.0 to "
        "reach the server from other machines, together with VLLM_API_KEY.",
        "docker-compose.yml ports",
    )
    VLLM_API_KEY: str | None = knob(
        None,
        "API key clients must send (Authorization: Bearer KEY). Passed to vLLM through the "
        "environment, never on the command line, never printed.",
        "env VLLM_API_KEY",
        secret=True,
    )
    API_KEY_FILE: Path = knob(
        Path("api_key.txt"),
        "File read for the API key when VLLM_API_KEY is unset (first line, stripped). "
        "A missing file means no key.",
        "env VLLM_API_KEY",
    )

    # --- model ------------------------------------------------------------------------
    MODELS_DIR: Path = knob(
        Path("models"), "Folder that holds prepared models.", "model path prefix"
    )
    MODEL: str = knob(
        "Qwen3.8-27B-W4A16-hq",
        "Model to serve: a folder name inside MODELS_DIR, or a path to a model folder. "
        "Its folder name is the model id clients use (--served-model-name).",
        "vllm serve PATH, --served-model-name",
    )
    MAX_LEN: int | None = knob(
        None,
        "Longest prompt + answer in tokens. Default: the profile's (single 65536, 131072 or "
        "262144 for CTX=fast, long or huge; batch 150000) or what the card holds, if less. A "
        "value the card cannot hold is refused before vLLM starts.",
        "--max-model-len",
        ge=256,
    )
    MAX_SEQS: int | None = knob(
        None,
        "Requests decoded at once (slots). Default: single 4 (CTX=huge: 1), as many of them "
        "as the card holds at full length; batch 64, or as many requests of 2,048 tokens as "
        "stay resident on the card, if fewer. A value the card cannot hold is refused.",
        "--max-num-seqs",
        ge=1,
        le=1024,
    )
    GPU_UTIL: float = knob(
        0.90,
        "Fraction of GPU memory vLLM may take (weights + cache + activations). Lower it if a "
        "desktop shares the card.",
        "--gpu-memory-utilization",
        gt=0.05,
        le=0.99,
    )
    KV_MEM: str | None = knob(
        None,
        "Fixed KV-cache size in bytes; when set, vLLM sizes the cache from it instead of "
        "GPU_UTIL. Suffixes as vLLM reads them: K/M/G/T = powers of 1024 (6G = 6 GiB), "
        "k/m/g/t = powers of 1000 (decimals allowed: 6.5g).",
        "--kv-cache-memory-bytes",
        pattern=r"^(\d+[KMGT]?|\d+(\.\d+)?[kmgt])$",
    )
    KV: KvChoiceName | None = knob(
        None,
        "KV-cache dtype: vLLM 0.26's own choices that serve this hybrid model, and kvarn. Default: "
        "single: CTX's (fast auto = bf16, long/huge fp8); batch fp8. fp8 halves the cache "
        "(fp8_e4m3 is the same; fp8_e5m2 keeps less precision); *_per_token_head add a scale "
        "per token and head (int4 halves fp8 again) and run Triton attention, fp8_per_token_head "
        "on sm89+ only; turboquant_* (3-4 bit) run TurboQuant, never with SPEC other than off; "
        "kvarn: HyperQwen's 4-bit K / 2-bit (or 3-bit) V tiles (src/hyperqwen/kvarn), SPEC=mtp "
        "(at most 3 drafts) or off; the most context per GiB, but slower than fp8 today, in "
        "decode and far more in a cold prefill (docs/long-context.md, 'Decode deep in a long "
        "context'). "
        "Which works with what, and what a card holds with each: docs/long-context.md; "
        "batch/README.md has fp8's measured cost.",
        "--kv-cache-dtype (with --attention-backend where the dtype needs one)",
    )
    STATE_DTYPE: StateDtypeKnob = knob(
        "auto",
        "Dtype of the GDN recurrent state every request keeps (48 layers x 48 heads x 128 x "
        "128 at 27B), read and written every decode step. auto: single float32 (what the "
        "model's config asks for), batch bfloat16 (half the bytes, so more requests stay "
        "resident). float16: the same bytes as bfloat16 with more mantissa and less range "
        "(speed and quality not measured yet: batch/README.md). Residency per dtype: "
        "hyperqwen capacity --mode batch.",
        "--mamba-ssm-cache-dtype",
    )
    GPU_COUNT: int = knob(
        1,
        "GPUs to serve on; how they are used: GPU_SPLIT. docker-compose.yml reserves one GPU; "
        "for more, edit `count` there.",
        "--tensor-parallel-size or --data-parallel-size",
        ge=1,
        le=8,
    )
    GPU_SPLIT: GpuSplit | None = knob(
        None,
        "How GPU_COUNT > 1 GPUs serve. tp: one server sharded over them (tensor parallel: each "
        "request decodes faster; the model's heads must divide by GPU_COUNT); dp: one whole "
        "replica per GPU behind vLLM's own load balancer (more requests at once; each GPU must "
        "hold the whole model). Default: single tp (speculation gains nothing from replicas), "
        "batch dp.",
        "--tensor-parallel-size / --data-parallel-size",
    )
    EXTRA_ARGS: str = knob(
        "",
        "Extra vLLM arguments, split like a shell would, appended last: they win over every "
        "flag the launcher sets (the launcher warns when one does).",
        "appended to argv",
    )

    # --- API features -------------------------------------------------------------------
    TOOLS: Switch = knob(
        "1",
        "Let the model call tools (OpenAI tools / tool_choice=auto).",
        "--enable-auto-tool-choice --tool-call-parser TOOL_PARSER",
    )
    TOOL_PARSER: str = knob(
        "qwen3_coder", "vLLM tool-call parser (when TOOLS=1).", "--tool-call-parser", min_length=1
    )
    REASONING_PARSER: str = knob(
        "qwen3",
        "vLLM reasoning parser that splits <think> text into reasoning_content; "
        f"{NO_REASONING_PARSER!r} leaves it out (models without <think> tokens, whose "
        "requests the parser refuses).",
        "--reasoning-parser",
    )
    PREFIX_CACHE: Switch = knob(
        "1",
        "Reuse the KV cache and recurrent state of a shared prompt prefix (system prompts, "
        "multi-turn chats: a long history is then not prefilled again each turn). vLLM 0.26 "
        "runs it in an experimental mode for this hybrid model that raises TTFT when prompts "
        "share nothing (batch/README.md) and, with speculative decoding, waits for each "
        "step's accepted tokens before preparing the next (an engine feature skips that wait: "
        "src/hyperqwen/engine/README.md's feature table).",
        "--enable-prefix-caching / --no-enable-prefix-caching",
    )
    LINEAR_BACKEND: LinearBackend | None = knob(
        None,
        "Kernel for the int4 body GEMMs and int8 heads. auto: vLLM's choice (Machete on "
        "Hopper, Marlin on Ampere/Ada/Blackwell); marlin; machete (Hopper only); hyperqwen: "
        "HyperQwen's Triton W4A16 kernel for the int4 body at every M, Marlin for the rest (an "
        "engine feature: src/hyperqwen/engine/README.md's feature table says how far it is "
        "measured). Default: single "
        "marlin (faster at 1-16 tokens per step: 1.14x stock vLLM's MTP at C1 on the H200, "
        "against 1.01x with Machete), batch auto (Machete wins at 64).",
        f"--linear-backend (hyperqwen: marlin, and env {_switched_by('LINEAR_BACKEND')} for the "
        "patched vLLM)",
    )
    MODEL_RUNNER: ModelRunner = knob(
        "auto",
        "vLLM's GPU model runner. auto: vLLM's choice, V1 for this hybrid model; v1; v2: vLLM "
        "0.26's experimental V2 runner, which prepares each step's inputs on the GPU (MTP "
        "drafting and prefix caching's align mode included; speed not measured, exactness "
        "not decided yet: bench/measurements/2026-12-05-h100-step-knobs.json). The engine "
        "features that hook the V1 runner (their seams in "
        "src/hyperqwen/engine/README.md's table say 'V1 runner') stay off under v2; one of "
        "their knobs set to 1, or SPEC=ngram/lookup (V2 has no n-gram drafting), is refused.",
        "env VLLM_USE_V2_MODEL_RUNNER (v1: 0, v2: 1, auto: unset)",
    )
    INDUCTOR_PDL: Switch = knob(
        "0",
        "1: the Triton kernels torch.compile generates for the model (its fused norms, "
        "activations, residual adds) launch with programmatic dependent launch, each starting "
        "while its predecessor drains and waiting before it reads that kernel's output (torch "
        "Inductor's triton.enable_pdl). Only sm90 and newer (H100/H200, RTX 5090) have it: "
        "below, where Inductor would leave it out, `hyperqwen serve` refuses 1. Part of the "
        "compile cache key. Exact on an H100 (the same tokens as without: "
        "bench/measurements/2026-12-05-h100-step-knobs.json); speed not measured yet.",
        "--compilation-config inductor_compile_config triton.enable_pdl",
    )
    VISION: Switch = knob(
        "0",
        "Load the vision tower and accept images. 0 serves text only and frees its memory.",
        "--language-model-only when 0",
    )
    SSE_KEEP_ALIVE: float = knob(
        15.0,
        "Seconds of silence on a streaming response after which the server sends an SSE "
        "comment line, so proxies and clients do not time out during a long prefill; 0 turns "
        "it off.",
        "--sse-keep-alive-interval (patched vLLM)",
        ge=0,
        le=3600,
    )
    REQ_METRICS: Switch = knob(
        "0",
        "Add per-request timing metrics (queue, prefill, decode) to API responses.",
        "--enable-per-request-metrics",
    )

    # --- single mode ---------------------------------------------------------------------
    CTX: ContextProfile = knob(
        "fast",
        "Context profile. fast: 64k tokens, bf16 KV cache; long: 128k, fp8 KV; huge: 256k, "
        "fp8 KV, one slot. Each shrinks to what the card's memory holds (fewer slots first, "
        "then a shorter length; src/hyperqwen/capacity_fit.py), and the startup note says 'this "
        "card holds N tokens at M slots'.",
        "--max-model-len, --kv-cache-dtype, --max-num-batched-tokens defaults",
        modes=SINGLE,
    )
    SPEC: SpecMethod = knob(
        "mtp",
        "Speculative decoding. mtp: the model's own multi-token-prediction layer drafts; "
        "ngram: vLLM's n-gram drafts, copied from the prompt (no extra weights); lookup: "
        "HyperQwen's copy drafts from vLLM's CPU n-gram proposer (or on the GPU: LOOKUP_DEVICE): "
        "what followed the longest, most recent earlier occurrence of the last 2-12 tokens (for "
        "models without MTP; lossless; at 15 drafts it made 1.07-1.18x the tok/s of vLLM's CPU "
        "ngram at 15 on SmolLM2's copy tasks, "
        "docs/results/2026-12-07-h100-smollm2-quoting-lookup-any-match.json); off: none. ngram "
        "and lookup keep vLLM's default graphs: with full graphs of every step vLLM 0.26 "
        "answered chat prompts with garbage on the H100 "
        "(docs/results/2026-12-06-h100-smollm2-quoting-full-graphs.json).",
        "--speculative-config",
        modes=SINGLE,
    )
    DRAFT_TOKENS: int | None = knob(
        None,
        "Tokens drafted per step: 1-15, and up to 31 with SPEC=ngram or SPEC=lookup on the CPU "
        "(LOOKUP_DEVICE=cpu), whose searches run on the host (a feature whose kernels read "
        "the drafts may take fewer: it says so). "
        "Default: 3 for mtp, 4 for ngram "
        "and lookup (15 projects fastest, but each slot costs a GDN state: "
        'src/hyperqwen/engine/quoting.md, "Width"; pure-attention models should set 15 or '
        "more). With lookup and LOOKUP_FILL=0 only proposed drafts are verified, so a long "
        "block costs verify work only where the context repeats. With SPEC=mtp and "
        "quoting on, more than 3 is the widest block a copy fills while MTP drafts 3 "
        "(src/hyperqwen/engine/README.md's feature table). Each draft slot holds a GDN state per "
        "request: see hyperqwen capacity.",
        "--speculative-config num_speculative_tokens",
        modes=SINGLE,
        ge=1,
        le=31,
    )
    DRAFT_SAMPLE: DraftSample = knob(
        "greedy",
        "How the drafter picks tokens: greedy (argmax) or probabilistic (samples; can accept "
        "more at temperature > 0, costs memory for draft logits).",
        "--speculative-config draft_sample_method",
        modes=SINGLE,
    )

    @field_validator("HOST")
    @classmethod
    def _host_not_blank(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("must be an address such as 127.0.0.1 or 0.0.0.0, or unset")
        return value


def _owned_knob_field(declared: Knob, env: str) -> tuple[Any, Any]:
    """An engine feature's own knob as a Settings field; it becomes the feature's variable."""
    becomes = declared.becomes or f"env {env} (patched vLLM)"
    return Literal[declared.values], knob(declared.default, declared.help, becomes, declared.modes)


# The engine features' own knobs follow the ones above, in engine/features.py's order.
Settings = create_model(
    "Settings",
    __base__=ServingKnobs,
    __module__=__name__,
    __doc__="The effective configuration of one server. Field names are the environment "
    "variable names.",
    **{f.knob: _owned_knob_field(f.owned_knob, f.env) for f in FEATURES if f.owned_knob},
    **{name: _owned_knob_field(k, f.env) for f in FEATURES for name, k in f.more_knobs},
)


@dataclass(frozen=True)
class KnobInfo:
    """What the docs, the .env template and the checks need to know about one knob."""

    name: str
    default: Any
    help: str
    becomes: str
    modes: tuple[Mode, ...]
    secret: bool
    allowed: str


def _literal_values(annotation: Any) -> list[str]:
    if get_origin(annotation) is Literal:
        return [str(value) for value in get_args(annotation)]
    return [value for arg in get_args(annotation) for value in _literal_values(arg)]


def _allowed_text(annotation: Any, metadata: list[Any]) -> str:
    literal_values = _literal_values(annotation)
    if literal_values:
        return " | ".join(literal_values)
    bounds = []
    for item in metadata:
        for attr, symbol in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            if getattr(item, attr, None) is not None:
                bounds.append(f"{symbol} {getattr(item, attr)}")
        if getattr(item, "pattern", None):
            return "bytes, e.g. 6G (GiB) or 6.5g (10^9)"
    kinds = {int: "integer", float: "number", str: "text", Path: "path"}
    base = next((kinds[a] for a in (get_args(annotation) or (annotation,)) if a in kinds), "text")
    return base + (" " + ", ".join(bounds) if bounds else "")


def knobs() -> list[KnobInfo]:
    """All knobs in declaration order."""
    infos = []
    for name, info in Settings.model_fields.items():
        extra = info.json_schema_extra or {}
        infos.append(
            KnobInfo(
                name=name,
                default=info.default,
                help=info.description or "",
                becomes=str(extra["becomes"]),
                modes=tuple(extra["modes"]),
                secret=bool(extra["secret"]),
                allowed=_allowed_text(info.annotation, info.metadata),
            )
        )
    return infos


class SettingsError(Exception):
    """Invalid knob values; the message names each knob, the bad value and what is allowed."""

    exit_code = 2


@dataclass(frozen=True)
class LoadedSettings:
    settings: Settings
    explicit: frozenset[str]
    """Knobs the user set (environment or .env), as opposed to defaults."""
    sources: dict[str, str] = field(default_factory=dict)
    """Where each explicit knob came from: 'environment' or the .env path."""


def load_settings(
    environ: Mapping[str, str] | None = None,
    env_file: Path | None = None,
) -> LoadedSettings:
    """Read knobs from `env_file` (default $ENV_FILE or ./.env) and the environment, which wins.

    Empty strings count as unset, so `HOST=` in .env means "use the default".
    """
    environ = os.environ if environ is None else environ
    if env_file is None:
        env_file = Path(environ.get("ENV_FILE", ".env"))
    names = set(Settings.model_fields)
    values: dict[str, str] = {}
    sources: dict[str, str] = {}
    if env_file.is_file():
        for key, value in dotenv_values(env_file).items():
            if key in names and value not in (None, ""):
                values[key], sources[key] = value, str(env_file)
    for key in names:
        value = environ.get(key)
        if value not in (None, ""):
            values[key], sources[key] = value, "environment"
    try:
        settings = Settings.model_validate(values)
    except ValidationError as error:
        raise SettingsError(_explain(error, values)) from None
    return LoadedSettings(settings, frozenset(values), sources)


def _explain(error: ValidationError, values: Mapping[str, str]) -> str:
    allowed = {info.name: info.allowed for info in knobs()}
    lines = []
    for problem in error.errors():
        name = str(problem["loc"][0]) if problem["loc"] else "?"
        if name not in allowed:
            continue
        secret = Settings.model_fields[name].json_schema_extra["secret"]  # type: ignore[index]
        shown = "(hidden)" if secret else repr(values.get(name))
        lines.append(
            f"{name}={shown} is not valid: {problem['msg']}. Allowed: {allowed[name]}. "
            f"Fix it in the environment or in .env."
        )
    return "\n".join(lines)


def resolve_api_key(settings: Settings) -> tuple[str | None, str]:
    """The API key and where it came from: VLLM_API_KEY, else the first line of API_KEY_FILE."""
    if settings.VLLM_API_KEY:
        return settings.VLLM_API_KEY, "VLLM_API_KEY"
    path = settings.API_KEY_FILE
    if path.is_file():
        lines = path.read_text(encoding="utf-8").splitlines()
        key = lines[0].strip() if lines else ""
        if key:
            return key, str(path)
    return None, "unset"

"""`bench quoting-ceiling-result`: measured 27B step times joined with the copy-task
benchmark's tokens per step into projected 27B speeds, and the targets judged.

Measured (rows `measured_*`, from `bench quoting-ceiling` files): the step time of each k
(stock: k0's, so the ratio is what verifying k + 1 costs against the chat step), its spread
between passes, the chat speed without speculation (one token per k0 step) and, where mtp-k3
was measured, MTP's drafting (mtp-k3's step less k3's).

Projected (rows `projected_*`): per kind of the `bench quoting-result` file and configuration
projected, the kind's tokens per decode step (`_tokens_per_any_step`: steps without drafts
included) over the step time those steps take on the 27B: the share of them that verified drafts
(`_drafting_steps`) at the step time of the configuration's k (its --speculative-config
num_speculative_tokens: 15 for lookup at DRAFT_TOKENS=15; a step verifying fewer costs at most
that), the rest at k0's. Chat instead, where --chat-tokens-per-step is given (MTP's on real
weights: SmolLM2 has none, its file is --chat-source), verifies --chat-drafts every step (3: a
27B lookup server without a match verifies MTP's drafts) and makes that many tokens. Stock is
the measured chat speed, so the ratio is the projected speed over it; `_vs_own_chat` rows
compare a copy kind with the same configuration's projected chat. The result's `provenance`
names each row's input files.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from hyperqwen.bench.ab_argv import spec_config
from hyperqwen.bench.ab_plan import ABError
from hyperqwen.bench.quoting_ceiling_run import (
    MTP,
    MTP_DRAFTS,
    SAME_FLAGS,
    StepFigures,
    config_name,
    step_figures,
)
from hyperqwen.bench.quoting_configs import LOOKUP
from hyperqwen.bench.quoting_result import criterion, format_criteria, load_measurements, merge
from hyperqwen.bench.quoting_tasks import CONTROL_KIND, COPY_KINDS, KINDS
from hyperqwen.bench.results import (
    ComparisonRow,
    ResultFileError,
    comparison_row,
    format_comparison,
    load_result,
    result_document,
)

CEILING_SCHEMA = 1
CEILING_KIND = "bench quoting-ceiling measurements"
DEFAULT_PROJECTED = LOOKUP
CHAT_STEP = config_name(0)
QUOTING_TARGET = 3.0
"""Copy kinds: projected speed at least this many times the measured chat speed (issue 24)."""
CHAT_TARGET = 1.0
"""Chat: projected speed not below the chat speed without speculation."""
NOTES = (
    "Rows measured_* are step times measured on the served geometry (dummy weights, every "
    "draft accepted); rows projected_* are computed: the quoting result's tokens per step "
    "over those step times. None is a speed measured with real weights on this geometry.",
    f"Every server ran with {SAME_FLAGS} (vLLM turns it off for custom_class drafting): a "
    "server with async scheduling hides part of each step's host work, so its steps are at "
    "most these.",
    "A projection takes a kind's steps that drafted to verify the configuration's k + 1 tokens "
    "(a step verifying fewer costs at most that) and its other steps to cost k0's, with the "
    "tokens per decode step and the share that drafted from vLLM's counters on the quoting "
    "run; chat given --chat-tokens-per-step verifies --chat-drafts + 1 every step.",
    "The step times are verify steps: a 27B lookup server also runs MTP's drafting every step, "
    f"which measured_mtp_drafting prices where {MTP} was measured and the projections leave out.",
)


@dataclass(frozen=True)
class Inputs:
    steps: dict
    """The ceiling measurements, merged."""
    origin: dict[str, str]
    """Ceiling configuration -> the file it came from."""
    quoting: dict
    quoting_rows: dict[str, ComparisonRow]
    quoting_source: str


def load_inputs(paths: Sequence[Path], quoting_path: Path) -> Inputs:
    """The ceiling files merged and the quoting result, each checked; ResultFileError names the
    file and what is wrong."""
    loaded = load_measurements(paths)
    steps = merge(loaded, CEILING_KIND, CEILING_SCHEMA, ("plan",))
    origin = {name: source for source, document in loaded for name in document["configs"]}
    try:
        quoting, rows = load_result(quoting_path)
    except ResultFileError as error:
        raise ResultFileError(
            f"--quoting-result {error} (give a `hyperqwen bench quoting-result` file)"
        ) from None
    named = {row.name: row for row in rows}
    if not isinstance(quoting.get("configs"), dict) or not any(
        name.endswith("_tokens_per_step") for name in named
    ):
        raise ResultFileError(
            f"{quoting_path}: not a `hyperqwen bench quoting-result` file (it has no configs "
            "and no KIND_CONFIG_tokens_per_step rows); make one with `hyperqwen bench "
            "quoting-result MEASUREMENTS.json --out QR.json`"
        )
    return Inputs(steps, origin, quoting, named, str(quoting_path))


def verified_drafts(name: str, record: dict, source: str) -> int:
    """The drafts a quoting configuration verified per step: its server command's
    --speculative-config (its recorded speculative_config for a server given by URL)."""
    try:
        config = spec_config(record["command"]) if "command" in record else None
    except ABError as error:
        raise ResultFileError(f"{source}: {name}'s command: {error}") from None
    config = config or record.get("speculative_config")
    drafts = (config or {}).get("num_speculative_tokens")
    if not isinstance(drafts, int) or drafts < 1:
        raise ResultFileError(
            f"{source}: {name} has no --speculative-config with num_speculative_tokens (a "
            "server given by URL records none): project a configuration that speculates"
        )
    return drafts


@dataclass(frozen=True)
class ChatAssumption:
    """How the projected server's chat steps go where tokens_per_step is given (with the file
    it came from): every one verifies `drafts` and makes that many tokens. Without it chat is
    projected as the copy kinds are, from the configuration's own drafting."""

    drafts: int
    tokens_per_step: float | None = None
    source: str | None = None


@dataclass(frozen=True)
class Projection:
    config: str
    drafts: dict[str, int]
    """Kind -> the drafts its drafting steps verify (the configuration's; chat: assumed where
    the chat assumption gives its tokens per step)."""
    steps: dict[str, StepFigures | None]
    """Kind -> the step time of those drafts (None: not measured)."""
    speeds: dict[str, float | None]
    """Kind -> projected tok/s."""
    counted: dict[str, bool]
    """Kind -> whether the quoting result has its drafting figures (or chat is assumed)."""


def mixed_step_ms(
    drafting_pct: float | None, drafting_ms: float | None, idle_ms: float | None
) -> float | None:
    """The mean step time of a kind whose drafting_pct % of steps verify at drafting_ms and the
    rest, without drafts, take idle_ms (None where any is unknown)."""
    if drafting_pct is None or not drafting_ms or not idle_ms:
        return None
    share = drafting_pct / 100
    return share * drafting_ms + (1 - share) * idle_ms


def project(
    inputs: Inputs, names: Sequence[str], figures: dict[str, StepFigures], chat: ChatAssumption
) -> list[Projection]:
    idle = figures.get(CHAT_STEP)
    idle_ms = idle.step_ms if idle else None
    projections = []
    for name in names:
        if name not in inputs.quoting["configs"]:
            raise ResultFileError(
                f"--project {name}: {inputs.quoting_source} has no such configuration; it has "
                f"{', '.join(inputs.quoting['configs'])}"
            )
        own = verified_drafts(name, inputs.quoting["configs"][name], inputs.quoting_source)
        assumed = chat.tokens_per_step is not None
        drafts = {kind: chat.drafts if kind == CONTROL_KIND and assumed else own for kind in KINDS}
        steps = {kind: figures.get(config_name(drafts[kind])) for kind in KINDS}
        speeds, counted = {}, {}
        for kind in KINDS:
            step_ms = steps[kind].step_ms if steps[kind] else None  # type: ignore[union-attr]
            if kind == CONTROL_KIND and assumed:
                counted[kind] = True
                per_step = chat.tokens_per_step
            else:
                share, per_step = (
                    _patched(inputs.quoting_rows, f"{kind}_{name}_{suffix}")
                    for suffix in ("drafting_steps", "tokens_per_any_step")
                )
                counted[kind] = share is not None and per_step is not None
                # steps without drafts cost the chat step's
                step_ms = mixed_step_ms(share, step_ms, idle_ms)
            usable = step_ms and per_step is not None
            speeds[kind] = round(1000 * per_step / step_ms, 1) if usable else None  # type: ignore[operator]
        projections.append(Projection(name, drafts, steps, speeds, counted))
    return projections


def _patched(rows: dict[str, ComparisonRow], name: str) -> float | None:
    row = rows.get(name)
    return row.patched if row else None


def _spread(*figures: StepFigures | None) -> float | None:
    spreads = [figure.spread_pct if figure else None for figure in figures]
    return None if None in spreads else max(spreads)  # type: ignore[type-var]


def _criterion(text: str, target: float, value, reference, spread) -> dict:
    ratio = round(value / reference, 3) if value is not None and reference else None
    return criterion(text, target, ratio, spread)


def criteria(projections: list[Projection], chat: float | None, chat_step) -> list[dict]:
    """Issue 24's 27B targets per projected configuration, judged against the step spreads."""
    judged_criteria = []
    for projection in projections:
        name = projection.config
        for kind in (*COPY_KINDS, CONTROL_KIND):
            width = projection.drafts[kind] + 1
            if kind == CONTROL_KIND:
                text = f"projected 27B tok/s (verifying {width}) not below the measured chat tok/s"
                target = CHAT_TARGET
            else:
                text = (
                    f"projected 27B tok/s (verifying {width}) >= {QUOTING_TARGET:g}x the measured "
                    "chat tok/s"
                )
                target = QUOTING_TARGET
            spread = _spread(projection.steps[kind], chat_step)
            judged_criteria.append(
                _criterion(
                    f"{kind}: {name} {text} without speculation ({CHAT_STEP})",
                    target,
                    projection.speeds[kind],
                    chat,
                    spread,
                )
            )
    return judged_criteria


def measured_rows(figures: dict[str, StepFigures], origin: dict[str, str]):
    """The measured rows and, per row, its input file."""
    chat_step = figures.get(CHAT_STEP)
    base = chat_step.step_ms if chat_step else None
    rows, sources = [], {}
    for name, figure in figures.items():
        rows += [
            comparison_row(f"measured_step_{name}", "ms", base, figure.step_ms),
            comparison_row(f"measured_step_{name}_spread", "%", None, figure.spread_pct),
        ]
        sources |= {row.name: [origin[name]] for row in rows[-2:]}
    if chat_step:
        chat = round(1000 / base, 1) if base else None
        rows.append(comparison_row("measured_chat_decode", "tok/s", None, chat))
        sources[rows[-1].name] = [origin[CHAT_STEP]]
    verify = figures.get(config_name(MTP_DRAFTS))
    if MTP in figures and verify and figures[MTP].step_ms and verify.step_ms:
        drafting = round(figures[MTP].step_ms - verify.step_ms, 3)
        rows.append(comparison_row("measured_mtp_drafting", "ms", None, drafting))
        sources[rows[-1].name] = [origin[MTP], origin[config_name(MTP_DRAFTS)]]
    return rows, sources


def _inputs_of(projection: Projection, kind: str, inputs: Inputs, assumed: ChatAssumption):
    """Where a projected speed's tokens per step came from (the quoting result, or for chat
    --chat-source), its step time's file and the chat step's."""
    read = assumed.source if kind == CONTROL_KIND and assumed.source else None
    steps = (config_name(projection.drafts[kind]), CHAT_STEP)
    return [read or inputs.quoting_source, *(inputs.origin[n] for n in steps if n in inputs.origin)]


def projected_rows(
    projections: list[Projection], chat: float | None, inputs: Inputs, assumed: ChatAssumption
):
    """The projected rows and, per row, its input files."""
    rows, sources = [], {}
    for projection in projections:
        chat_inputs = _inputs_of(projection, CONTROL_KIND, inputs, assumed)
        for kind in KINDS:
            prefix = f"projected_{kind}_{projection.config}"
            speed = projection.speeds[kind]
            own = _inputs_of(projection, kind, inputs, assumed)
            rows.append(comparison_row(f"{prefix}_decode", "tok/s", chat, speed))
            sources[rows[-1].name] = list(dict.fromkeys(own))
            if kind in COPY_KINDS:
                own_chat = projection.speeds[CONTROL_KIND]
                rows.append(comparison_row(f"{prefix}_vs_own_chat", "tok/s", own_chat, speed))
                sources[rows[-1].name] = list(dict.fromkeys([*own, *chat_inputs]))
    return rows, sources


def build_result(
    inputs: Inputs, names: Sequence[str], chat_assumed: ChatAssumption, command: str
) -> tuple[dict, list]:
    """The docs/results document: measured rows, projected rows, provenance, criteria."""
    records = inputs.steps["configs"]
    order = sorted(records, key=lambda name: (name == MTP, records[name]["drafts"]))
    figures = {name: step_figures(records[name]) for name in order}
    projections = project(inputs, names, figures, chat_assumed)
    measured, measured_from = measured_rows(figures, inputs.origin)
    chat = next((row.patched for row in measured if row.name == "measured_chat_decode"), None)
    projected, projected_from = projected_rows(projections, chat, inputs, chat_assumed)
    provenance = {
        name: {"kind": "measured", "inputs": files} for name, files in measured_from.items()
    }
    provenance |= {
        name: {"kind": "projected", "inputs": files} for name, files in projected_from.items()
    }
    plan = inputs.steps["plan"]
    served = sorted({record["served_model"] for record in records.values()})
    facts = {
        "gpu": inputs.steps["gpu"],
        "vllm": "; ".join(sorted({f"stock {record['version']}" for record in records.values()})),
        "commit": inputs.steps["commit"],
        "date": inputs.steps["date"],
        "command": " && ".join([*inputs.steps["command"], command]),
        "model": f"{Path(plan['model'] or served[0]).name} (served as {', '.join(served)}; "
        f"tokens per step from {inputs.quoting['model']})",
    }
    refused = [
        f"{name}: refused passes left out ({figure.refused})"
        for name, figure in figures.items()
        if figure.refused
    ]
    missing = [
        f"{p.config}'s {label} steps verify {p.drafts[kind] + 1} tokens, and "
        f"{config_name(p.drafts[kind])} has no step time (not measured, or every pass "
        "refused): those projections are empty"
        for p in projections
        for label, kind in (("copy", COPY_KINDS[0]), (CONTROL_KIND, CONTROL_KIND))
        if p.steps[kind] is None or p.steps[kind].step_ms is None  # type: ignore[union-attr]
    ]
    uncounted = [
        f"{p.config}'s {kind}: the quoting result has no {kind}_{p.config}_drafting_steps and "
        "_tokens_per_any_step figures (measured before `bench quoting` kept vLLM's counters a "
        "pass): its projection is empty; measure it again"
        for p in projections
        for kind in KINDS
        if not p.counted[kind]
    ]
    details = {
        "criteria": criteria(projections, chat, figures.get(CHAT_STEP)),
        "provenance": provenance,
        "projected": {p.config: {"drafts_per_kind": p.drafts} for p in projections},
        "chat_assumption": asdict(chat_assumed),
        "quoting_result": inputs.quoting_source,
        "plan": plan,
        "configs": records,
        "notes": [*NOTES, *refused, *missing, *uncounted],
    }
    rows = [*measured, *projected]
    return result_document(facts, rows, **details), rows


def format_result(document: dict) -> list[str]:
    """The rows as a table (measured_* measured, projected_* computed), then the criteria."""
    rows = [ComparisonRow(**row) for row in document["rows"]]
    return [*format_comparison(rows), "", *format_criteria(document["criteria"])]

"""Run the preparation steps on a model folder: plan everything, then write in commit order.

Every output is a function of the base checkpoint and the options, computed (and every refusal
raised) before the first write. Then, under the folder's lock: the tensor steps' shards, config
and index (`tensors.execute`), each engine feature's step (the `write` of the module its
declaration names as prepare_step: marker.FEATURE_STEPS), the chat template, and last the
marker. Each write is atomic and idempotent, so after a crash at any point the next run
finishes the job and leaves the same bytes an uninterrupted run would have.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hyperqwen.checkpoint import shards
from hyperqwen.prepare import folder, marker, template, tensors
from hyperqwen.prepare.marker import Options
from hyperqwen.prepare.template import TemplateFile
from hyperqwen.prepare.tensors import TensorPlan
from hyperqwen.prepare.validate import Base, base_file, load_base


@dataclass
class StepReport:
    step: str
    title: str
    status: str  # "done", "already done", "skipped"
    details: dict = field(default_factory=dict)
    seconds: float = 0.0


@dataclass
class Plans:
    """Every output, computed before the first write."""

    tensors: TensorPlan
    template: TemplateFile | None
    template_text: str | None
    template_report: dict
    features: dict[str, Any]
    """Each feature step's plan, by step name (the steps not skipped)."""


def _plan(base: Base, options: Options, ranking: Path) -> Plans:
    steps = options.steps
    tensor_plan = tensors.plan(base, tensors.step_bits(options), options.max_error)
    found = template.find_template(lambda name: base_file(base.directory, name))
    template_text, template_report = None, {"changed": False, "reason": "no chat template"}
    if found is not None:
        text = found.template
        if "chat_template" in steps:
            hardening = template.harden(found.template)
            text, template_report = hardening.text, hardening.report
        template_text = found.with_template(text)
    features = {
        name: step.plan(base, options, ranking)
        for name, step in marker.FEATURE_STEPS.items()
        if name in steps
    }
    return Plans(tensor_plan, found, template_text, template_report, features)


def _tensor_reports(options: Options, measured, tensor_plan) -> list[StepReport]:
    reports = []
    for step in ("lm_head", "embed", "mtp"):
        if step not in options.steps:
            reports.append(StepReport(step, options.title(step), "skipped"))
            continue
        modules = {m: r for m, r in measured.modules.items() if tensor_plan.step_of[m] == step}
        if not modules:
            reports.append(StepReport(step, options.title(step), "done", {"modules": 0}))
            continue
        worst = max(modules.values(), key=lambda result: result["relative_error"])
        details = {
            "bits": worst["bits"],
            "group_size": worst["group_size"],
            "modules": len(modules),
            "relative_error": worst["relative_error"],
            "max_abs_error": worst["max_abs_error"],
            "max_error": tensors.error_bound(options.max_error, worst["bits"]),
        }
        if len(modules) > 1:
            details["per_module_relative_error"] = {
                module: result["relative_error"] for module, result in sorted(modules.items())
            }
        status = "done" if step in measured.written else "already done"
        reports.append(
            StepReport(step, options.title(step), status, details, measured.seconds.get(step, 0))
        )
    return reports


def _feature_step(
    name: str, base: Base, options: Options, plans: Plans, progress: bool
) -> StepReport:
    """An engine feature's step: its module writes its files, or, skipped, they go."""
    step = marker.FEATURE_STEPS[name]
    title = options.title(name)
    if name not in options.steps:
        for path in (base.directory / file for file in step.MODEL_FILES):
            if path.exists():
                folder.remove(path, f"remove:{path.name}")
        return StepReport(name, title, "skipped")
    started = time.monotonic()
    wrote, details = step.write(
        base, options, plans.features[name], plans.tensors.weight_map, progress
    )
    status = "done" if wrote else "already done"
    return StepReport(name, title, status, details, time.monotonic() - started)


def _template_step(base: Base, options: Options, plans: Plans) -> StepReport:
    title = options.title("chat_template")
    wrote = False
    if plans.template is not None:
        wrote = folder.replace_base_file(
            base.directory, plans.template.name, plans.template_text, "chat_template"
        )
    if "chat_template" not in options.steps:
        return StepReport("chat_template", title, "skipped")
    details = {"file": plans.template.name if plans.template else None, **plans.template_report}
    return StepReport("chat_template", title, "done" if wrote else "already done", details)


def prepare(
    model_dir: Path,
    options: Options,
    ranking: Path,
    progress: bool = True,
    on_step: Callable[[StepReport], None] = lambda report: None,
) -> list[StepReport]:
    """Bring the folder to what `options` ask for (see the module docstring)."""
    load_base(model_dir)  # refuse before the first write (the lock file is one)
    with folder.exclusive_lock(model_dir):
        folder.remove_stale_temporaries(model_dir)
        base = load_base(model_dir)  # again: another prepare may have run meanwhile
        plans = _plan(base, options, ranking)
        measured = tensors.execute(base, plans.tensors, progress)
        reports = _tensor_reports(options, measured, plans.tensors)
        for report in reports:
            on_step(report)
        for name in marker.FEATURE_STEPS:
            reports.append(_feature_step(name, base, options, plans, progress))
            on_step(reports[-1])
        reports.append(_template_step(base, options, plans))
        on_step(reports[-1])
        steps = {report.step: report.details for report in reports if report.status != "skipped"}
        text = marker.render(options, steps, marker.file_sha256(model_dir / shards.INDEX_NAME))
        folder.write_if_changed(marker.marker_path(model_dir), text, "marker")
    return reports

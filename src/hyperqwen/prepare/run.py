"""Run the preparation steps on a model folder: plan everything, then write in commit order.

Every output is a function of the base checkpoint and the options, computed (and every refusal
raised) before the first write. Then, under the folder's lock: the tensor steps' shards, config
and index (`tensors.execute`), the draft head and its id file, the chat template, and last the
marker. Each write is atomic and idempotent, so after a crash at any point the next run
finishes the job and leaves the same bytes an uninterrupted run would have.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from hyperqwen.checkpoint import shards
from hyperqwen.drafter import head, vocab
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
    vocabulary: list[int]
    ranking_text: str | None


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
    vocabulary, ranking_text = [], None
    if "draft_vocab" in steps:
        try:
            ranked = vocab.read_ranking(ranking)
            vocabulary = vocab.cut(ranked, options.draft_size, base.geometry.vocab_size)
        except (OSError, vocab.VocabError) as error:
            raise folder.Refused(f"draft vocabulary: {error}") from None
        ranking_text = ranking.read_text()
    return Plans(tensor_plan, found, template_text, template_report, vocabulary, ranking_text)


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


def _draft_step(base: Base, options: Options, plans: Plans, progress: bool) -> StepReport:
    model_dir = base.directory
    title = options.title("draft_vocab")
    head_path = model_dir / folder.DRAFT_HEAD_FILE
    ids_path = model_dir / folder.DRAFT_IDS_FILE
    if "draft_vocab" not in options.steps:
        for path in (head_path, ids_path):
            if path.exists():
                folder.remove(path, f"remove:{path.name}")
        return StepReport("draft_vocab", title, "skipped")
    started = time.monotonic()
    weight_map = plans.tensors.weight_map
    expected = head.fingerprint(plans.vocabulary, weight_map)
    wrote = False
    if not head.is_current(head_path, expected):
        with (
            tqdm(
                total=len(plans.vocabulary) * head.row_tensors(weight_map),
                unit="row",
                desc="draft head",
                disable=not progress,
            ) as bar,
            shards.atomic_file(head_path) as temporary,
            temporary.open("wb") as handle,
        ):
            head.write_head(handle, model_dir, weight_map, plans.vocabulary, bar.update)
        folder.write_point("draft_head")
        wrote = True
    ids_text = (
        f"# Draft vocabulary: {len(plans.vocabulary)} token ids, sorted; row i of "
        f"{folder.DRAFT_HEAD_FILE} is token ids[i].\n"
        f"# Cut from the ranking {folder.DRAFT_RANKING_FILE} (sha256 "
        f"{options.draft_ranking_sha256[:16]}...): special tokens, then the most frequent ids.\n"
        + "".join(f"{token_id}\n" for token_id in plans.vocabulary)
    )
    wrote |= folder.write_if_changed(ids_path, ids_text, "draft_ids")
    wrote |= folder.write_if_changed(
        model_dir / folder.DRAFT_RANKING_FILE, plans.ranking_text, "draft_ranking"
    )
    details = {
        "size": len(plans.vocabulary),
        "ids_file": folder.DRAFT_IDS_FILE,
        "head_file": folder.DRAFT_HEAD_FILE,
        "ranking_sha256": options.draft_ranking_sha256,
    }
    status = "done" if wrote else "already done"
    return StepReport("draft_vocab", title, status, details, time.monotonic() - started)


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
        for step in (
            lambda: _draft_step(base, options, plans, progress),
            lambda: _template_step(base, options, plans),
        ):
            reports.append(step())
            on_step(reports[-1])
        steps = {report.step: report.details for report in reports if report.status != "skipped"}
        text = marker.render(options, steps, marker.file_sha256(model_dir / shards.INDEX_NAME))
        folder.write_if_changed(marker.marker_path(model_dir), text, "marker")
    return reports

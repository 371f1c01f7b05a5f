"""The draft vocabulary's `hyperqwen prepare` step (the draft_vocab engine feature's, declared as
its prepare_step): the ids cut from a ranking and the matching rows of the prepared lm_head.

prepare/run.py calls `plan` before its first write (every refusal raised there) and `write`
after the tensor steps, whose weight map the head's rows come from. The files it writes are
MODEL_FILES; prepare removes them when the step is skipped.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hyperqwen.drafter import vocab
from hyperqwen.engine.features import DRAFT_VOCAB
from hyperqwen.prepare import folder

TITLE = "draft vocabulary ({size} ids) and draft head"
MODEL_FILES = (folder.DRAFT_HEAD_FILE, folder.DRAFT_IDS_FILE)


@dataclass(frozen=True)
class Plan:
    vocabulary: list[int]
    ranking_text: str


def loads_model_files(settings: Any) -> bool:
    """Whether the server loads the draft head: MTP drafts, the draft vocabulary not off."""
    return settings.SPEC == "mtp" and getattr(settings, DRAFT_VOCAB.knob) != "off"


def plan(base: Any, options: Any, ranking: Path) -> Plan:
    """The vocabulary to write, or prepare's refusal naming the ranking's problem."""
    try:
        ranked = vocab.read_ranking(ranking)
        vocabulary = vocab.cut(ranked, options.draft_size, base.geometry.vocab_size)
    except (OSError, vocab.VocabError) as error:
        raise folder.Refused(f"draft vocabulary: {error}") from None
    return Plan(vocabulary, ranking.read_text())


def write(
    base: Any, options: Any, planned: Plan, weight_map: dict, progress: bool
) -> tuple[bool, dict]:
    """Write the head, the id file and the kept ranking where they differ from what `plan`
    asks for; returns (whether anything was written, the step's details for the marker)."""
    from tqdm import tqdm

    from hyperqwen.checkpoint import shards
    from hyperqwen.drafter import head

    model_dir = base.directory
    head_path = model_dir / folder.DRAFT_HEAD_FILE
    expected = head.fingerprint(planned.vocabulary, weight_map)
    wrote = False
    if not head.is_current(head_path, expected):
        with (
            tqdm(
                total=len(planned.vocabulary) * head.row_tensors(weight_map),
                unit="row",
                desc="draft head",
                disable=not progress,
            ) as bar,
            shards.atomic_file(head_path) as temporary,
            temporary.open("wb") as handle,
        ):
            head.write_head(handle, model_dir, weight_map, planned.vocabulary, bar.update)
        folder.write_point("draft_head")
        wrote = True
    ids_text = (
        f"# Draft vocabulary: {len(planned.vocabulary)} token ids, sorted; row i of "
        f"{folder.DRAFT_HEAD_FILE} is token ids[i].\n"
        f"# Cut from the ranking {folder.DRAFT_RANKING_FILE} (sha256 "
        f"{options.draft_ranking_sha256[:16]}...): special tokens, then the most frequent ids.\n"
        + "".join(f"{token_id}\n" for token_id in planned.vocabulary)
    )
    wrote |= folder.write_if_changed(model_dir / folder.DRAFT_IDS_FILE, ids_text, "draft_ids")
    wrote |= folder.write_if_changed(
        model_dir / folder.DRAFT_RANKING_FILE, planned.ranking_text, "draft_ranking"
    )
    details = {
        "size": len(planned.vocabulary),
        "ids_file": folder.DRAFT_IDS_FILE,
        "head_file": folder.DRAFT_HEAD_FILE,
        "ranking_sha256": options.draft_ranking_sha256,
    }
    return wrote, details

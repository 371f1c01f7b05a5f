"""The draft vocabulary's `hyperqwen prepare` step (the draft_vocab engine feature's, declared as
its prepare_step): the ids cut from a ranking and the matching rows of the prepared lm_head.

prepare/run.py calls `plan` before its first write (every refusal raised there) and `write`
after the tensor steps, whose weight map the head's rows come from. The files it writes are
MODEL_FILES; prepare removes them when the step is skipped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hyperqwen.checkpoint.shards import read_header
from hyperqwen.checkpoint.w4a16_sizes import GROUP_SIZE
from hyperqwen.drafter import vocab
from hyperqwen.engine.features import DRAFT_VOCAB
from hyperqwen.prepare import folder

# The model dtype the engine widens a prepared head's int8 rows to (engine/draft_vocab.py:
# load_draft_head), bf16 for every checkpoint HyperQwen serves
SERVED_ROW_BYTES = 2

TITLE = "draft vocabulary ({size} ids) and draft head"
MODEL_FILES = (folder.DRAFT_HEAD_FILE, folder.DRAFT_IDS_FILE)


@dataclass(frozen=True)
class Plan:
    vocabulary: list[int]
    ranking_text: str


def loads_model_files(settings: Any) -> bool:
    """Whether the server loads the draft head: MTP drafts, the draft vocabulary not off."""
    return settings.SPEC == "mtp" and getattr(settings, DRAFT_VOCAB.knob) != "off"


def served_bytes(model_dir: Path) -> int:
    """GPU bytes the server holds for the draft head (the capacity budget's count; 0 where the
    folder has none): its rows in the model dtype, whatever their stored width, and its ids."""
    path = model_dir / folder.DRAFT_HEAD_FILE
    if not path.is_file():
        return 0
    # head.PREFIX's names (head.py imports torch, which the launcher's budget does not)
    stored = {
        name.removeprefix("draft_head."): entry for name, entry in read_header(path).tensors.items()
    }
    if "weight_packed" in stored:  # int8 rows, as draft_head_int8.serve_refusal reads them:
        # N rows of GROUP_SIZE x the scales' columns, from the header alone
        rows, groups = stored["weight_packed"].shape[0], stored["weight_scale"].shape[1]
        elements = rows * groups * GROUP_SIZE
    else:
        elements = math.prod(stored["weight"].shape) if "weight" in stored else 0
    ids = stored.get("token_ids")
    return elements * SERVED_ROW_BYTES + (ids.nbytes if ids is not None else 0)


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

"""Token-id rankings and the draft vocabulary cut from them.

A ranking file is text: `#` comment lines (where it came from, how it was made, its coverage),
then token ids, one per line, most frequent first. The draft vocabulary is the special tokens
(always: a drafter that cannot propose `<|im_end|>` or `</think>` stalls every turn) followed
by the ranking's ids until it holds N, written sorted.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

DEFAULT_DRAFT_SIZE = 40_960
DATA_DIR = Path(__file__).resolve().parent.parent / "data"
DEFAULT_RANKING = DATA_DIR / "draft-ranking-sharegpt.txt"


class VocabError(ValueError):
    """A ranking that cannot give the draft vocabulary asked for; the message says why."""


def special_ids() -> list[int]:
    from hyperqwen.checkpoint.tokenizer import SPECIAL_TOKEN_IDS

    return sorted(SPECIAL_TOKEN_IDS.values())


def ranking_from_counts(counts: Counter[int]) -> list[int]:
    """Ids by falling count; equal counts in id order, so the ranking is deterministic."""
    return [
        token_id for token_id, _ in sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    ]


def write_ranking(path: Path, ranked: Sequence[int], comments: Iterable[str]) -> None:
    lines = [f"# {comment}".rstrip() for comment in comments]
    path.write_text("\n".join([*lines, *map(str, ranked)]) + "\n")


def read_ranking(path: Path) -> list[int]:
    """The ids of a ranking file, most frequent first; VocabError naming the line otherwise."""
    ranked = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        if not text.isdigit():
            raise VocabError(f"{path}:{number}: {text!r} is not a token id")
        ranked.append(int(text))
    if len(set(ranked)) != len(ranked):
        raise VocabError(f"{path}: a token id is listed twice; a ranking lists each id once")
    return ranked


def cut(ranked: Sequence[int], size: int, vocab_size: int) -> list[int]:
    """The draft vocabulary: special tokens, then the ranking, until `size` ids; sorted."""
    chosen = dict.fromkeys(special_ids())
    for token_id in ranked:
        if len(chosen) >= size:
            break
        if token_id >= vocab_size:
            raise VocabError(f"token id {token_id} is outside the vocabulary ({vocab_size} ids)")
        chosen[token_id] = None
    if len(chosen) < size:
        raise VocabError(
            f"the ranking gives only {len(chosen)} distinct ids (special tokens included), "
            f"fewer than the {size} asked for; lower --draft-size or rank more text"
        )
    return sorted(chosen)


def coverage(vocabulary: Iterable[int], counts: Counter[int]) -> float:
    """Share of the counted tokens whose id is in `vocabulary`."""
    chosen = set(vocabulary)
    total = sum(counts.values())
    return sum(count for token_id, count in counts.items() if token_id in chosen) / total

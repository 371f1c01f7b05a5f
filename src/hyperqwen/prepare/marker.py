"""`hyperqwen-prepare.json`: what prepare did to a model folder, and the quick "all done" check.

The marker is written last, after every step's files, so its presence means the steps it lists
are on disk. It records the options (they persist: a later plain `hyperqwen prepare`, like the
compose service's on every `up`, keeps them), each step's parameters and measured errors, and a
hash of the index it committed, so a folder changed behind prepare's back is not taken as done.
Reading it needs no torch and no safetensors: the quick path stays well under a second.
"""

from __future__ import annotations

import hashlib
import importlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from hyperqwen.checkpoint.shards import INDEX_NAME
from hyperqwen.drafter.vocab import DEFAULT_DRAFT_SIZE
from hyperqwen.engine.features import FEATURES

# The engine features' steps (their declarations' prepare_step modules), named after them, in
# FEATURES' order between the tensor steps and the chat template's.
FEATURE_STEPS = {
    f.name: importlib.import_module(f.prepare_step) for f in FEATURES if f.prepare_step
}
STEPS = ("lm_head", "embed", "mtp", *FEATURE_STEPS, "chat_template")
TITLES = {
    "lm_head": "lm_head -> int8 group-128",
    "embed": "embed_tokens -> int8 group-128",
    "mtp": "MTP linears -> int{bits} group-128",
    **{name: step.TITLE for name, step in FEATURE_STEPS.items()},
    "chat_template": "chat template hardening",
}
MARKER_REVISION = 1
# What a finished `hyperqwen prepare` leaves in the model folder (doctor and serve look for it).
PREPARED_MARKER = "hyperqwen-prepare.json"
PERCENT_KEYS = frozenset({"relative_error", "max_error"})


@dataclass(frozen=True)
class Options:
    """Resolved options: what the folder should look like once prepare is done."""

    skip: tuple[str, ...] = ()
    mtp_bits: int = 8
    draft_size: int = DEFAULT_DRAFT_SIZE
    max_error: float = 0.01
    draft_ranking_sha256: str = ""

    @property
    def steps(self) -> tuple[str, ...]:
        return tuple(step for step in STEPS if step not in self.skip)

    def title(self, step: str) -> str:
        return TITLES[step].format(bits=self.mtp_bits, size=self.draft_size)

    def to_json(self) -> dict:
        return {**asdict(self), "skip": list(self.skip)}

    @classmethod
    def from_json(cls, raw: dict) -> Options:
        return cls(**{**raw, "skip": tuple(raw.get("skip", ()))})


def marker_path(model_dir: Path) -> Path:
    return model_dir / PREPARED_MARKER


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def read(model_dir: Path) -> dict | None:
    try:
        raw = json.loads(marker_path(model_dir).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return raw if raw.get("revision") == MARKER_REVISION else None


def recorded_options(model_dir: Path) -> Options | None:
    raw = read(model_dir)
    try:
        return Options.from_json(raw["options"]) if raw else None
    except (KeyError, TypeError):
        return None


def is_done(model_dir: Path, options: Options) -> bool:
    """The quick check: the marker records exactly these options and the index it committed is
    the one in the folder."""
    raw = read(model_dir)
    index = model_dir / INDEX_NAME
    return bool(
        raw
        and raw.get("options") == options.to_json()
        and index.is_file()
        and raw.get("index_sha256") == file_sha256(index)
    )


def render(options: Options, steps: dict[str, dict], index_sha256: str) -> str:
    return (
        json.dumps(
            {
                "revision": MARKER_REVISION,
                "options": options.to_json(),
                "index_sha256": index_sha256,
                "steps": steps,
            },
            indent=2,
        )
        + "\n"
    )


def status_lines(model_dir: Path) -> list[str]:
    """One line per step: done (with its parameters and measured errors) or not."""
    raw = read(model_dir)
    if raw is None:
        return [f"{model_dir}: not prepared (no {PREPARED_MARKER})"]
    index = model_dir / INDEX_NAME
    current = index.is_file() and raw.get("index_sha256") == file_sha256(index)
    options = Options.from_json(raw["options"])
    lines = [
        f"{model_dir}: prepared"
        + ("" if current else " (the index changed since: run hyperqwen prepare again)")
    ]
    for step in STEPS:
        done = raw["steps"].get(step)
        if done is None:
            lines.append(f"  {options.title(step):<44} not done (skipped)")
            continue
        lines.append(f"  {options.title(step):<44} done: {describe(done)}")
    return lines


def describe(details: dict) -> str:
    """One line for a step's recorded details: errors in percent, hashes shortened, nested
    values (per-module errors) left to the marker file."""
    shown = []
    for key, value in details.items():
        if isinstance(value, dict | list):
            continue
        if key in PERCENT_KEYS:
            value = f"{value:.3%}"
        elif key.endswith("sha256"):
            value = f"{value[:12]}..."
        shown.append(f"{key.replace('_', ' ')} {value}")
    return ", ".join(shown)

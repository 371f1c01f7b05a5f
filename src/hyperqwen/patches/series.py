"""Reading the patch series: the `series` file, each diff's preamble and its file sections.

Everything here only reads and validates; `hyperqwen.patches.tree` does the patching.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

KINDS = ("fix", "feature", "backport", "local")
PREAMBLE_FIELDS = ("Kind", "What", "Upstream", "Retires-when")
DIFF_SUFFIXES = (".patch", ".diff")
SERIES_FILE = "series"
SERIES_DIR_ENV = "HYPERQWEN_PATCHES_DIR"

PREAMBLE_TEMPLATE = """\
Kind: fix|feature|backport|local
What: one sentence on what the patch changes and why
Upstream: https://github.com/vllm-project/vllm/pull/NNNN (or: none)
Retires-when: the condition under which the patch can be dropped"""


_HUNK_HEADER = re.compile(r"^@@ -\d+(?:,(\d+))? \+\d+(?:,(\d+))? @@")
# (old, new) lines each hunk body marker stands for; "" is a context line whose trailing space
# an editor stripped, "\\" is "\\ No newline at end of file".
_HUNK_LINE_COUNTS = {" ": (1, 1), "": (1, 1), "-": (1, 0), "+": (0, 1), "\\": (0, 0)}
_FIELD_LINE = re.compile(r"^([A-Za-z][A-Za-z-]*):\s*(.*)$")
# `diff -N` marks a missing side with the epoch instead of /dev/null; GNU patch then treats a
# "new" file that already exists as one to prepend to, so such diffs are refused.
_EPOCH_STAMP = re.compile(r"^1970-01-01[ T]00:00:00")


class PatchSeriesError(Exception):
    """The series cannot be used or applied; the message names the file and the fix."""


@dataclass(frozen=True)
class FileChange:
    """One file section of a diff: the path inside vllm/ and its hunk headers."""

    path: str
    creates: bool
    hunks: tuple[str, ...]


@dataclass(frozen=True)
class Patch:
    name: str
    path: Path
    kind: str
    what: str
    upstream: str
    retires_when: str
    changes: tuple[FileChange, ...]

    @property
    def touched_paths(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(change.path for change in self.changes))


@dataclass(frozen=True)
class Series:
    directory: Path
    patches: tuple[Patch, ...]

    @property
    def touched_paths(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(p for patch in self.patches for p in patch.touched_paths))


def default_series_dir() -> Path:
    """$HYPERQWEN_PATCHES_DIR, else the `patches/` folder of this source checkout, else the copy
    a regular (non-editable) install puts in <venv>/share/hyperqwen/patches."""
    if configured := os.environ.get(SERIES_DIR_ENV):
        return Path(configured)
    # src/hyperqwen/patches/series.py -> the checkout root holds patches/
    checkout = Path(__file__).resolve().parents[3] / "patches"
    if (checkout / "series").is_file():
        return checkout
    return Path(sys.prefix) / "share" / "hyperqwen" / "patches"


def load_series(series_dir: Path | None = None) -> Series:
    """Read `series_dir/series` and every diff it names; refuse any series/folder mismatch."""
    series_dir = series_dir or default_series_dir()
    series_file = series_dir / SERIES_FILE
    if not series_file.is_file():
        raise PatchSeriesError(
            f"no patch series at {series_file}: pass --series-dir or set {SERIES_DIR_ENV} "
            "to the folder holding `series` and the diffs"
        )
    names = series_names(series_file)
    on_disk = {p.name for p in series_dir.iterdir() if p.suffix in DIFF_SUFFIXES and p.is_file()}
    unlisted = sorted(on_disk - set(names))
    absent = [name for name in names if not (series_dir / name).is_file()]
    if unlisted or absent:
        problems = [f"{name} is in {series_dir} but not in {series_file}" for name in unlisted]
        problems += [
            f"{name} is listed in {series_file} but no such file exists" for name in absent
        ]
        raise PatchSeriesError(
            "the patch series and its folder disagree, refusing to start:\n  "
            + "\n  ".join(problems)
            + f"\nList every diff of {series_dir} in {series_file} (in apply order) or delete it."
        )
    return Series(series_dir, tuple(parse_patch(series_dir / name) for name in names))


def series_names(series_file: Path) -> list[str]:
    names: list[str] = []
    for number, raw in enumerate(series_file.read_text().splitlines(), 1):
        name = raw.split("#", 1)[0].strip()
        if not name:
            continue
        if "/" in name or not name.endswith(DIFF_SUFFIXES):
            raise PatchSeriesError(
                f"{series_file}:{number}: {name!r} is not a diff file name; entries are plain "
                f"file names next to the series file, ending in {' or '.join(DIFF_SUFFIXES)}"
            )
        if name in names:
            raise PatchSeriesError(f"{series_file}:{number}: {name} is listed twice")
        names.append(name)
    return names


def parse_patch(path: Path) -> Patch:
    """Parse one diff: its preamble fields and its file sections (validated, not applied)."""
    lines = path.read_text().splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("--- ")), None)
    if start is None:
        raise PatchSeriesError(
            f"{path}: no unified diff found (no '--- a/...' line); make it with diff -u"
        )
    fields = _preamble_fields(path, lines[:start])
    return Patch(
        name=path.name,
        path=path,
        kind=fields["kind"],
        what=fields["what"],
        upstream=fields["upstream"],
        retires_when=fields["retires-when"],
        changes=tuple(_file_changes(path, lines, start)),
    )


def _preamble_fields(path: Path, preamble: list[str]) -> dict[str, str]:
    wanted = {name.lower() for name in PREAMBLE_FIELDS}
    fields: dict[str, str] = {}
    current = None
    for line in preamble:
        match = _FIELD_LINE.match(line)
        if match and match.group(1).lower() in wanted:
            current = match.group(1).lower()
            if current in fields:
                raise PatchSeriesError(f"{path}: preamble field {match.group(1)}: appears twice")
            fields[current] = match.group(2).strip()
        elif current and line[:1].isspace() and line.strip():
            fields[current] = f"{fields[current]} {line.strip()}".strip()
        else:
            current = None  # free-form notes may follow the fields
    missing = [name for name in PREAMBLE_FIELDS if not fields.get(name.lower())]
    if missing:
        raise PatchSeriesError(
            f"{path}: preamble lacks {', '.join(missing)}; start the file with\n"
            f"{PREAMBLE_TEMPLATE}\nbefore its first '--- ' line"
        )
    if fields["kind"] not in KINDS:
        raise PatchSeriesError(f"{path}: Kind: {fields['kind']!r} is not one of {', '.join(KINDS)}")
    upstream = fields["upstream"]
    if upstream != "none" and not upstream.startswith(("https://", "http://")):
        raise PatchSeriesError(
            f"{path}: Upstream: {upstream!r} must be a PR/issue URL or the word none"
        )
    return fields


def _file_changes(path: Path, lines: list[str], index: int) -> Iterable[FileChange]:
    while index < len(lines):
        if not lines[index].startswith("--- "):
            index += 1  # `diff ...`/`index ...` lines between sections, as GNU patch allows
            continue
        if index + 1 >= len(lines) or not lines[index + 1].startswith("+++ "):
            raise PatchSeriesError(f"{path}:{index + 2}: expected '+++ b/...' after '--- '")
        old = _header_path(path, index + 1, lines[index], "a/")
        new = _header_path(path, index + 2, lines[index + 1], "b/")
        if old and new and old != new:
            raise PatchSeriesError(
                f"{path}:{index + 1}: renames are not supported ({old} -> {new}); "
                "delete the old file and create the new one from /dev/null"
            )
        if not old and not new:
            raise PatchSeriesError(f"{path}:{index + 1}: both sides are /dev/null")
        index += 2
        hunks = []
        while index < len(lines) and lines[index].startswith("@@ "):
            hunks.append(lines[index])
            index = _skip_hunk_body(path, lines, index)
        if not hunks:
            raise PatchSeriesError(f"{path}:{index + 1}: file section {old or new} has no hunks")
        yield FileChange(path=new or old, creates=old is None, hunks=tuple(hunks))


def _header_path(path: Path, number: int, line: str, prefix: str) -> str | None:
    name, _, stamp = line[4:].partition("\t")
    if name == "/dev/null":
        return None
    if _EPOCH_STAMP.match(stamp.strip()):
        raise PatchSeriesError(
            f"{path}:{number}: {name} is dated 1970-01-01 (a `diff -N` new or deleted file); "
            "write that side as /dev/null so an existing file is never patched by mistake"
        )
    parts = name.split("/")
    if not name.startswith(prefix) or len(parts) < 2 or ".." in parts or "" in parts[1:]:
        raise PatchSeriesError(
            f"{path}:{number}: {name!r} must be {prefix}<path inside the vllm/ package> "
            "(paths relative to the vllm/ directory, applied with -p1)"
        )
    return name[len(prefix) :]


def _skip_hunk_body(path: Path, lines: list[str], index: int) -> int:
    match = _HUNK_HEADER.match(lines[index])
    if not match:
        raise PatchSeriesError(f"{path}:{index + 1}: malformed hunk header {lines[index]!r}")
    old_left = int(match.group(1) or 1)
    new_left = int(match.group(2) or 1)
    index += 1
    while old_left > 0 or new_left > 0:
        if index >= len(lines):
            raise PatchSeriesError(f"{path}: the diff ends inside a hunk (truncated file?)")
        step = _HUNK_LINE_COUNTS.get(lines[index][:1])
        if step is None or step[0] > old_left or step[1] > new_left:
            raise PatchSeriesError(
                f"{path}:{index + 1}: the hunk's line counts do not match its body "
                "(hand-edited diff? regenerate it with diff -u)"
            )
        old_left, new_left = old_left - step[0], new_left - step[1]
        index += 1
    while index < len(lines) and lines[index].startswith("\\"):
        index += 1
    return index

"""The patch series for the pinned vLLM: `hyperqwen patches apply|verify|list`.

`patches/series` lists the diffs in apply order, one file name per line (`#` starts a
comment). Each diff is a unified diff with paths relative to the `vllm/` package directory
(`--- a/entrypoints/...` / `+++ b/entrypoints/...`, applied with `-p1`; new files come from
`--- /dev/null`). Before its first `--- ` line a diff carries a preamble with the fields
`Kind:` (fix|feature|backport|local), `What:`, `Upstream:` (a URL or "none") and
`Retires-when:`; `PATCHES.md` is generated from these preambles.

GNU patch does the patching, always with zero fuzz (`-F0`): a hunk whose context moved is
fine (the offset is reported), a hunk whose context changed is a conflict. Whether a patch is
already applied is decided by an exact reverse dry-run. Applying is atomic per series: every
patch is first applied to a scratch copy of the touched files, in order (a patch may build on
an earlier one), and only when all succeed are the results moved into the vLLM tree.
"""

from __future__ import annotations

import argparse
import enum
import filecmp
import functools
import importlib.util
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from hyperqwen.settings import PINNED_VLLM

KINDS = ("fix", "feature", "backport", "local")
PREAMBLE_FIELDS = ("Kind", "What", "Upstream", "Retires-when")
DIFF_SUFFIXES = (".patch", ".diff")
SERIES_FILE = "series"
SERIES_DIR_ENV = "HYPERQWEN_PATCHES_DIR"
EXIT_NOT_APPLIED = 1
EXIT_BAD_SERIES = 2

PREAMBLE_TEMPLATE = """\
Kind: fix|feature|backport|local
What: one sentence on what the patch changes and why
Upstream: https://github.com/vllm-project/vllm/pull/NNNN (or: none)
Retires-when: the condition under which the patch can be dropped"""

# Zero fuzz; --forward so GNU patch never guesses a direction (with -R and --batch alone it
# silently un-reverses an unapplied patch and reports success); no backups or .rej files.
_PATCH_OPTIONS = (
    "-p1",
    "-F0",
    "--forward",
    "--batch",
    "--no-backup-if-mismatch",
    "--reject-file=-",
    "--quoting-style=literal",
)
_HUNK_HEADER = re.compile(r"^@@ -\d+(?:,(\d+))? \+\d+(?:,(\d+))? @@")
# (old, new) lines each hunk body marker stands for; "" is a context line whose trailing space
# an editor stripped, "\\" is "\\ No newline at end of file".
_HUNK_LINE_COUNTS = {" ": (1, 1), "": (1, 1), "-": (1, 0), "+": (0, 1), "\\": (0, 0)}
_FIELD_LINE = re.compile(r"^([A-Za-z][A-Za-z-]*):\s*(.*)$")
_PATCH_CHECKING = re.compile(r"^(?:checking|patching) file (.+)$")
_PATCH_HUNK_FAILED = re.compile(r"^Hunk #(\d+) FAILED at (\d+)")
_PATCH_HUNK_OFFSET = re.compile(r"^Hunk #(\d+) succeeded at (\d+) \(offset (-?\d+) lines?\)")
_PATCH_HUNK_SUMMARY = re.compile(r"^\d+ out of \d+ hunks? (?:FAILED|ignored)")
# `diff -N` marks a missing side with the epoch instead of /dev/null; GNU patch then treats a
# "new" file that already exists as one to prepend to, so such diffs are refused.
_EPOCH_STAMP = re.compile(r"^1970-01-01[ T]00:00:00")


class PatchSeriesError(Exception):
    """The series cannot be used or applied; the message names the file and the fix."""


class PatchConflictError(PatchSeriesError):
    """Some patch does not apply to the tree; nothing was changed."""


class PatchState(enum.StrEnum):
    APPLIED = "applied"
    MISSING = "missing"
    CONFLICTING = "conflicting"


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


@dataclass(frozen=True)
class PatchCheck:
    """Where one patch stands against a tree; notes carry offsets or the failing hunks."""

    patch: Patch
    state: PatchState
    notes: tuple[str, ...] = ()


# --- locating things -------------------------------------------------------------------------


def default_series_dir() -> Path:
    """$HYPERQWEN_PATCHES_DIR, else the `patches/` folder of this source checkout, else the copy
    a regular (non-editable) install puts in <venv>/share/hyperqwen/patches."""
    if configured := os.environ.get(SERIES_DIR_ENV):
        return Path(configured)
    checkout = Path(__file__).resolve().parents[2] / "patches"
    if (checkout / "series").is_file():
        return checkout
    return Path(sys.prefix) / "share" / "hyperqwen" / "patches"


def default_vllm_dir() -> Path:
    """The `vllm` package directory of this interpreter, found without importing vllm."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise PatchSeriesError(
            f"vllm is not installed for {sys.executable}; install vllm=={PINNED_VLLM} "
            "(bash install.sh) or pass the vllm package directory as DIR"
        )
    return Path(next(iter(spec.submodule_search_locations)))


@functools.cache
def _gnu_patch() -> str:
    found = shutil.which("patch")
    version = ""
    if found:
        version = subprocess.run(
            [found, "--version"], capture_output=True, text=True, check=False
        ).stdout
    if not version.startswith("GNU patch"):
        raise PatchSeriesError(
            "GNU patch is needed to apply the vLLM patch series and was not found on PATH "
            "(install it: apt-get install patch)"
        )
    return found


# --- reading the series ----------------------------------------------------------------------


def load_series(series_dir: Path | None = None) -> Series:
    """Read `series_dir/series` and every diff it names; refuse any series/folder mismatch."""
    series_dir = series_dir or default_series_dir()
    series_file = series_dir / SERIES_FILE
    if not series_file.is_file():
        raise PatchSeriesError(
            f"no patch series at {series_file}: pass --series-dir or set {SERIES_DIR_ENV} "
            "to the folder holding `series` and the diffs"
        )
    names = _series_names(series_file)
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


def _series_names(series_file: Path) -> list[str]:
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


# --- checking and applying -------------------------------------------------------------------


def check_series(series: Series, vllm_dir: Path) -> list[PatchCheck]:
    """Where every patch stands against vllm_dir; the tree is only read."""
    with tempfile.TemporaryDirectory(prefix="hyperqwen-patches-") as scratch:
        return _walk_series(series, vllm_dir, Path(scratch))


def apply_series(series: Series, vllm_dir: Path) -> list[PatchCheck]:
    """Apply the missing patches, all or none; returns their states from before applying.

    Raises PatchConflictError naming every conflicting patch and hunk; the tree is then
    untouched.
    """
    with tempfile.TemporaryDirectory(prefix="hyperqwen-patches-") as scratch:
        checks = _walk_series(series, vllm_dir, Path(scratch))
        conflicts = [check for check in checks if check.state is PatchState.CONFLICTING]
        if conflicts:
            raise PatchConflictError(
                f"refusing to apply: {len(conflicts)} patch(es) conflict with {vllm_dir}; "
                "nothing was changed\n" + "\n".join(_describe(check) for check in conflicts)
            )
        try:
            _move_into_tree(Path(scratch), vllm_dir, series.touched_paths)
        except OSError as error:
            raise PatchSeriesError(
                f"cannot write the patched files into {vllm_dir}: {error}; run as a user who "
                "may write there (the owner of that Python environment)"
            ) from error
    return checks


def series_status(vllm_dir: Path | None = None, series_dir: Path | None = None) -> tuple[bool, str]:
    """For `hyperqwen doctor`: is the whole series applied to vllm_dir?

    vllm_dir defaults to this interpreter's vllm package, series_dir to the repo's `patches/`.
    Returns (True, summary) when every patch is applied (an empty series counts as applied),
    else (False, one line naming the missing and conflicting patches). Raises PatchSeriesError
    when nothing can be checked (vllm not installed, series/folder mismatch, no GNU patch).
    """
    series = load_series(series_dir)
    if not series.patches:
        return True, "the patch series is empty (vLLM runs unpatched)"
    checks = check_series(series, vllm_dir or default_vllm_dir())
    not_applied = [check for check in checks if check.state is not PatchState.APPLIED]
    if not not_applied:
        return True, f"all {len(checks)} patches of the series applied"
    listed = ", ".join(f"{check.patch.name} {check.state}" for check in not_applied)
    return False, f"{len(not_applied)} of {len(checks)} patches not applied: {listed}"


def _walk_series(series: Series, vllm_dir: Path, scratch: Path) -> list[PatchCheck]:
    """Judge every patch on a scratch copy of the touched files, quilt-style.

    First peel the applied patches off, last to first: an exact reverse dry-run says a patch is
    applied, and it must come off before the one below it is judged, since a later patch may
    edit lines an earlier one added. Then apply the whole series forward on what is left, so
    each patch is judged on top of the ones before it. The copy ends fully patched.
    """
    if not (vllm_dir / "__init__.py").is_file():
        raise PatchSeriesError(
            f"{vllm_dir} is not a Python package directory; DIR must be the vllm/ package "
            "itself, e.g. .../site-packages/vllm"
        )
    for relative in series.touched_paths:
        if (vllm_dir / relative).is_file():
            (scratch / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(vllm_dir / relative, scratch / relative)
    applied = set()
    for patch in reversed(series.patches):
        if _apply_if_clean(patch, scratch, reverse=True).returncode == 0:
            applied.add(patch.name)
    checks = []
    for patch in series.patches:
        absent = [
            f"{change.path}: not found in {vllm_dir}"
            for change in patch.changes
            if not change.creates and not (scratch / change.path).is_file()
        ]
        if absent:
            checks.append(PatchCheck(patch, PatchState.CONFLICTING, tuple(absent)))
            continue
        trial = _apply_if_clean(patch, scratch, reverse=False)
        if trial.returncode != 0:
            checks.append(PatchCheck(patch, PatchState.CONFLICTING, _failures(patch, trial)))
        elif patch.name in applied:
            checks.append(PatchCheck(patch, PatchState.APPLIED))
        else:
            checks.append(PatchCheck(patch, PatchState.MISSING, _offsets(trial)))
    return checks


def _apply_if_clean(patch: Patch, root: Path, *, reverse: bool) -> subprocess.CompletedProcess[str]:
    """Dry-run the patch; apply it for real only when the dry run was clean. Returns the dry
    run, whose output tells the offsets or the failing hunks."""
    trial = _run_patch(patch, root, reverse=reverse, dry_run=True)
    if trial.returncode == 0:
        _run_patch(patch, root, reverse=reverse, dry_run=False).check_returncode()
    return trial


def _run_patch(
    patch: Patch, root: Path, *, reverse: bool, dry_run: bool
) -> subprocess.CompletedProcess[str]:
    command = [_gnu_patch(), *_PATCH_OPTIONS, "-d", str(root), "-i", str(patch.path)]
    command += ["-R"] * reverse + ["--dry-run"] * dry_run
    done = subprocess.run(
        command, capture_output=True, text=True, check=False, env={**os.environ, "LC_ALL": "C"}
    )
    if done.returncode > 1:
        raise PatchSeriesError(
            f"GNU patch could not read {patch.path}:\n{(done.stderr or done.stdout).strip()}"
        )
    return done


def _offsets(done: subprocess.CompletedProcess[str]) -> tuple[str, ...]:
    notes, current = [], "?"
    for line in done.stdout.splitlines():
        if checking := _PATCH_CHECKING.match(line):
            current = checking.group(1)
        elif offset := _PATCH_HUNK_OFFSET.match(line):
            number, at, by = offset.groups()
            notes.append(f"{current}: hunk #{number} applies at line {at} (offset {by})")
    return tuple(notes)


def _failures(patch: Patch, done: subprocess.CompletedProcess[str]) -> tuple[str, ...]:
    # GNU patch numbers hunks per file section and announces each section with
    # "checking file X"; count the announcements to find the section's hunk headers.
    sections: dict[str, list[FileChange]] = {}
    for change in patch.changes:
        sections.setdefault(change.path, []).append(change)
    seen: dict[str, int] = {}
    notes, current = [], "?"
    for line in (done.stdout + done.stderr).splitlines():
        if checking := _PATCH_CHECKING.match(line):
            current = checking.group(1)
            seen[current] = seen.get(current, 0) + 1
        elif failed := _PATCH_HUNK_FAILED.match(line):
            number, at = failed.groups()
            hunks = sections[current][seen[current] - 1].hunks
            notes.append(
                f"{current}: hunk #{number} {hunks[int(number) - 1]} does not apply at line "
                f"{at} with zero fuzz (its context lines differ)"
            )
        elif line.strip() and not _PATCH_HUNK_SUMMARY.match(line):
            notes.append(f"GNU patch: {line.strip()}")
    return tuple(notes)


def _move_into_tree(scratch: Path, vllm_dir: Path, paths: Sequence[str]) -> None:
    """Make vllm_dir's copies of `paths` equal scratch's: write every new version beside its
    target first, then rename them all into place, so a failure while writing (say, a full
    disk) leaves the tree as it was."""
    staged: list[tuple[Path, Path]] = []
    removals: list[Path] = []
    made_dirs: list[Path] = []
    try:
        for relative in paths:
            new, live = scratch / relative, vllm_dir / relative
            if not new.exists():
                if live.exists():
                    removals.append(live)
                continue
            if live.exists() and filecmp.cmp(new, live, shallow=False):
                continue
            for parent in reversed(live.relative_to(vllm_dir).parents[:-1]):
                if not (vllm_dir / parent).is_dir():
                    (vllm_dir / parent).mkdir()
                    made_dirs.append(vllm_dir / parent)
            handle, temporary = tempfile.mkstemp(dir=live.parent, prefix=f".{live.name}.")
            os.close(handle)
            staged.append((Path(temporary), live))
            shutil.copyfile(new, temporary)
            mode = live.stat().st_mode if live.exists() else new.stat().st_mode
            os.chmod(temporary, stat.S_IMODE(mode))
    except BaseException:
        for temporary, _ in staged:
            temporary.unlink(missing_ok=True)
        for directory in reversed(made_dirs):
            directory.rmdir()
        raise
    for temporary, live in staged:
        os.replace(temporary, live)
    for live in removals:
        live.unlink()


# --- presenting ------------------------------------------------------------------------------


def _describe(check: PatchCheck) -> str:
    return "\n".join([f"{check.state:<11} {check.patch.name}"] + [f"    {n}" for n in check.notes])


def render_markdown(series: Series) -> str:
    """PATCHES.md: one table row per patch, generated from the preambles."""
    head = (
        "# vLLM patches\n\n"
        f"The patches HyperQwen applies to vLLM {PINNED_VLLM}, in apply order. Generated from the\n"
        "preambles in `patches/` by `hyperqwen patches list --markdown > PATCHES.md`; do not edit\n"
        "by hand (a test fails when this file and `patches/series` drift). The format is in\n"
        "`patches/README.md`.\n\n"
    )
    if not series.patches:
        return head + f"_The series is empty: vLLM {PINNED_VLLM} runs unpatched._\n"
    rows = [
        "| # | Patch | Kind | What | Upstream | Retires when |",
        "|---|---|---|---|---|---|",
    ]
    for number, patch in enumerate(series.patches, 1):
        cells = [
            str(number),
            f"`{patch.name}`",
            patch.kind,
            patch.what,
            patch.upstream,
            patch.retires_when,
        ]
        rows.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return head + "\n".join(rows) + "\n"


def _render_list(series: Series) -> str:
    if not series.patches:
        return f"The series in {series.directory / SERIES_FILE} is empty: vLLM runs unpatched.\n"
    blocks = []
    for number, patch in enumerate(series.patches, 1):
        blocks.append(
            f"{number:>2}. {patch.name} ({patch.kind})\n"
            f"    what:         {patch.what}\n"
            f"    upstream:     {patch.upstream}\n"
            f"    retires when: {patch.retires_when}\n"
            f"    touches:      {', '.join(patch.touched_paths)}"
        )
    return "\n".join(blocks) + "\n"


# --- command line ----------------------------------------------------------------------------


def _cmd_list(args: argparse.Namespace) -> int:
    series = load_series(args.series_dir)
    sys.stdout.write(render_markdown(series) if args.markdown else _render_list(series))
    return 0


def _cmd_apply(args: argparse.Namespace) -> int:
    series = load_series(args.series_dir)
    vllm_dir = args.dir or default_vllm_dir()
    if not series.patches:
        print(f"the patch series is empty: nothing to apply to {vllm_dir}")
        return 0
    for check in apply_series(series, vllm_dir):
        if check.state is PatchState.APPLIED:
            print(f"unchanged   {check.patch.name} (already applied)")
        else:
            print(_describe(PatchCheck(check.patch, PatchState.APPLIED, check.notes)))
    print(f"the series is applied to {vllm_dir}")
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    series = load_series(args.series_dir)
    vllm_dir = args.dir or default_vllm_dir()
    checks = check_series(series, vllm_dir)
    for check in checks:
        print(_describe(check))
    not_applied = [check for check in checks if check.state is not PatchState.APPLIED]
    if not not_applied:
        print(f"the whole series ({len(checks)} patches) is applied to {vllm_dir}")
        return 0
    print(
        f"{len(not_applied)} of {len(checks)} patches are not applied to {vllm_dir}; "
        "`hyperqwen patches apply` adds the missing ones (a conflicting one needs the patch "
        "or the tree fixed first)"
    )
    return EXIT_NOT_APPLIED


def _guarded(command):
    @functools.wraps(command)
    def run(args: argparse.Namespace) -> int:
        try:
            return command(args)
        except PatchSeriesError as error:
            print(f"hyperqwen patches {args.patches_command}: {error}", file=sys.stderr)
            return EXIT_NOT_APPLIED if isinstance(error, PatchConflictError) else EXIT_BAD_SERIES

    return run


def add_subcommand(subparsers) -> None:
    """Add `patches` (apply, verify, list) to an argparse subparsers object."""
    patches = subparsers.add_parser(
        "patches",
        help="apply, verify or list HyperQwen's patches to vLLM",
        description=f"HyperQwen runs vLLM {PINNED_VLLM} with a series of patches "
        "(patches/series, one diff per topic, described in PATCHES.md). DIR is the vllm/ "
        "package directory to work on; it defaults to the one this Python would import "
        f"(found without importing it). Exit codes: 0 ok, {EXIT_NOT_APPLIED} not all applied "
        f"(verify) or a conflict (apply), {EXIT_BAD_SERIES} unusable series.",
    )
    actions = patches.add_subparsers(dest="patches_command", required=True, metavar="ACTION")
    series_help = (
        f"folder holding `series` and the diffs (default: ${SERIES_DIR_ENV}, else the "
        "repository's patches/)"
    )
    dir_help = "the vllm/ package directory (default: the vllm this Python imports)"

    apply = actions.add_parser(
        "apply",
        help="apply the missing patches, all or none",
        description="Apply every patch of the series that is not yet applied, in series order, "
        "with zero fuzz. Patches already applied are left alone, so running it twice changes "
        "nothing. All patches are tried on a scratch copy first: if any conflicts, the command "
        "names the patch and hunk and leaves DIR untouched. Example: hyperqwen patches apply",
    )
    verify = actions.add_parser(
        "verify",
        help="report each patch as applied, missing or conflicting",
        description="Report, for each patch in series order, whether DIR has it applied, "
        "missing (apply would add it) or conflicting (apply would refuse). Exits "
        f"{EXIT_NOT_APPLIED} unless all are applied. DIR is only read.",
    )
    for action, func in ((apply, _cmd_apply), (verify, _cmd_verify)):
        action.add_argument("dir", metavar="DIR", nargs="?", type=Path, help=dir_help)
        action.add_argument("--series-dir", type=Path, help=series_help)
        action.set_defaults(func=_guarded(func))

    listing = actions.add_parser(
        "list",
        help="show the series (or regenerate PATCHES.md with --markdown)",
        description="Show the patches in apply order with their preambles. "
        "Regenerate PATCHES.md with: hyperqwen patches list --markdown > PATCHES.md",
    )
    listing.add_argument(
        "--markdown", action="store_true", help="print PATCHES.md (the table of patches) instead"
    )
    listing.add_argument("--series-dir", type=Path, help=series_help)
    listing.set_defaults(func=_guarded(_cmd_list))

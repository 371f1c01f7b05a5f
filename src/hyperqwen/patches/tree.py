"""Checking and applying the patch series to a vLLM tree with GNU patch.

GNU patch does the patching, always with zero fuzz (`-F0`): a hunk whose context moved is
fine (the offset is reported), a hunk whose context changed is a conflict. Whether a patch is
already applied is decided by an exact reverse dry-run. Applying is atomic per series: every
patch is first applied to a scratch copy of the touched files, in order (a patch may build on
an earlier one), and only when all succeed are the results moved into the vLLM tree.
"""

from __future__ import annotations

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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hyperqwen.patches.series import FileChange, Patch, PatchSeriesError, Series, load_series
from hyperqwen.settings import PINNED_VLLM

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
_PATCH_CHECKING = re.compile(r"^(?:checking|patching) file (.+)$")
_PATCH_HUNK_FAILED = re.compile(r"^Hunk #(\d+) FAILED at (\d+)")
_PATCH_HUNK_OFFSET = re.compile(r"^Hunk #(\d+) succeeded at (\d+) \(offset (-?\d+) lines?\)")
_PATCH_HUNK_SUMMARY = re.compile(r"^\d+ out of \d+ hunks? (?:FAILED|ignored)")


class PatchConflictError(PatchSeriesError):
    """Some patch does not apply to the tree; nothing was changed."""


class PatchState(enum.StrEnum):
    APPLIED = "applied"
    MISSING = "missing"
    CONFLICTING = "conflicting"


@dataclass(frozen=True)
class PatchCheck:
    """Where one patch stands against a tree; notes carry offsets or the failing hunks."""

    patch: Patch
    state: PatchState
    notes: tuple[str, ...] = ()


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
                "nothing was changed\n" + "\n".join(describe(check) for check in conflicts)
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


def describe(check: PatchCheck) -> str:
    return "\n".join([f"{check.state:<11} {check.patch.name}"] + [f"    {n}" for n in check.notes])

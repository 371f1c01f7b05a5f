"""The model folder as prepare writes it: where things live, the lock, crash-safe writes.

Every write prepare makes goes through here: a temporary file beside its target, fsynced and
renamed over it (`shards.atomic_file`), then a *write point*. Files prepare replaces are first
copied, once, into `.hyperqwen/pristine/` (shards are moved there, not copied, once nothing
refers to them any more), so the base can always be recomputed from.

Write points are also the crash test's handle: with `HYPERQWEN_PREPARE_KILL_AT=<point>` the
process SIGKILLs itself right after reaching that point (a real kill, no cleanup runs), and with
`HYPERQWEN_PREPARE_TRACE=<file>` every point reached is appended to that file.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

from hyperqwen.checkpoint.shards import atomic_file

CONFIG_NAME = "config.json"
PLACE_BY_HAND = (
    "put the base checkpoint's files (config.json, model.safetensors.index.json, every "
    "model-*.safetensors shard, tokenizer.json, tokenizer_config.json, chat_template.jinja) "
    "into {folder}"
)
WORK_DIR = ".hyperqwen"
PRISTINE_DIR = f"{WORK_DIR}/pristine"
MEASUREMENTS_DIR = f"{WORK_DIR}/measurements"
LOCK_FILE = f"{WORK_DIR}/prepare.lock"
DRAFT_HEAD_FILE = "hyperqwen-draft-head.safetensors"
DRAFT_IDS_FILE = "hyperqwen-draft-vocab.txt"
# The ranking the draft vocabulary was cut from, kept so a later --draft-size can recut it.
DRAFT_RANKING_FILE = f"{WORK_DIR}/draft-ranking.txt"
KILL_ENV = "HYPERQWEN_PREPARE_KILL_AT"
TRACE_ENV = "HYPERQWEN_PREPARE_TRACE"


class Refused(Exception):
    """Prepare will not go on; the message names the file or knob and what to do."""


def write_point(name: str) -> None:
    """Mark that a durable write just completed (see the module docstring)."""
    trace = os.environ.get(TRACE_ENV)
    if trace:
        with open(trace, "a") as log:
            log.write(name + "\n")
    if os.environ.get(KILL_ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)


def write_bytes(path: Path, data: bytes, point: str) -> None:
    with atomic_file(path) as temporary:
        temporary.write_bytes(data)
    write_point(point)


def write_text(path: Path, text: str, point: str) -> None:
    write_bytes(path, text.encode(), point)


def write_if_changed(path: Path, text: str, point: str) -> bool:
    """Write `text` unless the file already holds exactly it (re-runs then write nothing)."""
    if path.is_file() and path.read_bytes() == text.encode():
        return False
    write_text(path, text, point)
    return True


def replace_base_file(model_dir: Path, name: str, text: str, point: str) -> bool:
    """Replace one of the base's files (config.json, the index, the chat template): a copy of
    the base version goes to the pristine folder first, once."""
    if (model_dir / name).is_file() and (model_dir / name).read_bytes() == text.encode():
        return False
    back_up_once(model_dir, name)
    return write_if_changed(model_dir / name, text, point)


def pristine_path(model_dir: Path, name: str) -> Path:
    return model_dir / PRISTINE_DIR / name


def back_up_once(model_dir: Path, name: str) -> None:
    """Copy `name` into the pristine folder unless a copy is already there (the first one is
    the base; later ones would be prepare's own output)."""
    backup = pristine_path(model_dir, name)
    if backup.exists() or not (model_dir / name).exists():
        return
    backup.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(backup) as temporary:
        shutil.copyfile(model_dir / name, temporary)
    write_point(f"backup:{name}")


def move(source: Path, target: Path, point: str) -> None:
    """Rename within the folder (same file system: atomic), then make the rename durable."""
    target.parent.mkdir(parents=True, exist_ok=True)
    os.rename(source, target)
    for directory in {source.parent, target.parent}:
        descriptor = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
    write_point(point)


def remove(path: Path, point: str) -> None:
    path.unlink()
    write_point(point)


def remove_stale_temporaries(model_dir: Path) -> None:
    """Delete the temporary files of a prepare that was killed mid-write (call under the lock:
    then no other prepare is writing any)."""
    for folder in (model_dir, model_dir / PRISTINE_DIR, model_dir / MEASUREMENTS_DIR):
        if folder.is_dir():
            for path in folder.glob(".*.tmp"):
                path.unlink()


@contextlib.contextmanager
def exclusive_lock(model_dir: Path) -> Iterator[None]:
    """Hold an exclusive flock on the folder's lock file, or refuse at once if another prepare
    holds it (the kernel drops the lock when that process dies, however it dies)."""
    lock_path = model_dir / LOCK_FILE
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise Refused(
                f"another `hyperqwen prepare` is working on {model_dir} (it holds {lock_path}); "
                "wait for it to finish, or stop it and run prepare again (it resumes)"
            ) from None
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)

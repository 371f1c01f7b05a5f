"""Shared by the prepare tests: one synthetic base per session, and prepare run in-process or in
a subprocess. (No tests here; the other test_prepare*.py files import from it.)

The base is the `tiny` preset at hidden_size 128 (the smallest the int4 kernels take), written by
`synthesize` in 40 MB shards: embed_tokens and lm_head get shards of their own, the body and the
MTP head share others, so prepare rewrites some shards and leaves others alone.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import process_group

from hyperqwen.checkpoint.geometry import PRESETS
from hyperqwen.checkpoint.synthesize import synthesize
from hyperqwen.prepare.cli import add_subcommand

ROOT = Path(__file__).resolve().parents[1]
GEOMETRY = PRESETS["tiny"].with_overrides(["hidden_size=128"])
SHARD_BYTES = 40_000_000
SEED = 3


def tiny_base_dir(tmp_path_factory) -> Path:
    """The synthetic base, written once per test session."""
    directory = tmp_path_factory.getbasetemp() / "prepare-tiny-base"
    if not directory.exists():
        synthesize(directory, GEOMETRY, seed=SEED, max_shard_bytes=SHARD_BYTES, progress=False)
    return directory


def _link_shards(source: str, target: str) -> None:
    if source.endswith(".safetensors"):
        os.link(source, target)
    else:  # small files, and the lock file, whose inode the flock belongs to
        shutil.copy2(source, target)


def copy_base(base: Path, target: Path) -> Path:
    """A copy of a model folder whose shards are hard links: instant, and safe, because prepare
    never writes into an existing file (it renames new ones over old). A test that edits a shard
    in place must unlink it first (`own_copy`)."""
    shutil.copytree(base, target, copy_function=_link_shards)
    return target


def own_copy(path: Path) -> Path:
    """Give `path` its own bytes, so editing it in place leaves the shared base alone."""
    data = path.read_bytes()
    path.unlink()
    path.write_bytes(data)
    return path


def run_prepare(*argv: str) -> tuple[int, str, str]:
    """`hyperqwen prepare ARGV` in this process; (exit code, stdout, stderr)."""
    parser = argparse.ArgumentParser(prog="hyperqwen")
    add_subcommand(parser.add_subparsers())
    args = parser.parse_args(["prepare", *argv])
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = args.func(args)
    return code, stdout.getvalue(), stderr.getvalue()


PREPARE_SCRIPT = """
import argparse, sys
from hyperqwen.prepare.cli import add_subcommand
parser = argparse.ArgumentParser(prog="hyperqwen")
add_subcommand(parser.add_subparsers())
args = parser.parse_args(["prepare", *sys.argv[1:]])
sys.exit(args.func(args))
"""


# Runs prepare as its only child and prints the child's peak RSS (KiB) as the last line.
MEASURE_SCRIPT = """
import resource, subprocess, sys
done = subprocess.run([sys.executable, "-c", sys.argv[1], *sys.argv[2:]])
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
sys.exit(done.returncode)
"""


def prepare_process(
    *argv: str, env: dict[str, str] | None = None, measure_memory: bool = False, prelude: str = ""
) -> subprocess.CompletedProcess:
    """`hyperqwen prepare ARGV` in a fresh interpreter (for kills, locks and memory); with
    `measure_memory` its peak RSS in KiB is the last line of stdout. `prelude` is Python run
    in that interpreter first."""
    environment = {
        "PATH": os.environ["PATH"],
        "PYTHONPATH": str(ROOT / "src"),
        "HOME": os.environ.get("HOME", "/tmp"),
        **(env or {}),
    }
    script = prelude + PREPARE_SCRIPT
    launcher = ["-c", MEASURE_SCRIPT, script] if measure_memory else ["-c", script]
    return process_group.run(
        [sys.executable, *launcher, *argv],
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )


def prepare_copy(base: Path, target: Path, *argv: str) -> Path:
    copy_base(base, target)
    code, _, err = run_prepare(str(target), "--quiet", *argv)
    assert code == 0, err
    return target


def tree_digest(directory: Path) -> dict[str, str]:
    """sha256 of every file under `directory` by relative path."""
    return {
        str(path.relative_to(directory)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }

"""Prepare killed with SIGKILL right after each of its write points, then run again: the second
run completes and the folder is byte-identical to one prepared without interruption.

The write points are those an uninterrupted run passes (HYPERQWEN_PREPARE_TRACE lists them);
HYPERQWEN_PREPARE_KILL_AT=<point> makes the real code SIGKILL its own process there, so nothing
(no `finally`, no atexit, no buffered write) runs after it. Each run is its own process, forked
from a multiprocessing forkserver that has already imported torch and hyperqwen, which keeps the
~40 runs to seconds each.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
from pathlib import Path

import pytest
from test_prepare_common import copy_base, run_prepare, tiny_base_dir, tree_digest

from hyperqwen.prepare.folder import KILL_ENV, TRACE_ENV
from hyperqwen.prepare.marker import PREPARED_MARKER

CONTEXT = multiprocessing.get_context("forkserver")
CONTEXT.set_forkserver_preload(
    [
        "test_prepare_common",
        "hyperqwen.prepare.run",
        "hyperqwen.prepare.tensors",
        "hyperqwen.prepare.template",
        "hyperqwen.drafter.head",
        "transformers.utils.chat_template_utils",
    ]
)
PARALLEL = 2


def _prepare_child(model_dir: str, environment: dict[str, str]) -> None:
    """One `hyperqwen prepare` run, in a process of its own."""
    import torch

    torch.set_num_threads(1)  # PARALLEL runs share the cores
    os.environ.update(environment)
    sys.stdout = sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - the process ends here
    code, _, _ = run_prepare(model_dir, "--quiet")
    sys.exit(code)


def _run_all(jobs: list[tuple[Path, dict[str, str]]]) -> list[int | None]:
    """Run prepare once per job, PARALLEL at a time; their exit codes (-9: killed)."""
    codes: list[int | None] = []
    for start in range(0, len(jobs), PARALLEL):
        processes = [
            CONTEXT.Process(target=_prepare_child, args=(str(model), environment))
            for model, environment in jobs[start : start + PARALLEL]
        ]
        try:
            for process in processes:
                process.start()
            for process in processes:
                process.join(timeout=240)
                codes.append(process.exitcode)  # None: still running at the deadline
        finally:  # none outlives its batch, whatever stopped the test
            for process in processes:
                if process.is_alive():
                    process.kill()
                    process.join()
    return codes


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A base prepared without interruption, and the write points that run passed."""
    base = tiny_base_dir(tmp_path_factory)
    folder = tmp_path_factory.mktemp("crash")
    model = copy_base(base, folder / "reference")
    trace = folder / "points.txt"
    assert _run_all([(model, {TRACE_ENV: str(trace)})]) == [0]
    return base, model, trace.read_text().split()


def test_the_write_points_cover_every_kind_of_write(reference):
    _, _, points = reference
    kinds = {point.split(":")[0] for point in points}
    assert kinds == {
        "measurements",
        "shard",
        "backup",
        "config",
        "index",
        "retire",
        "draft_head",
        "draft_ids",
        "draft_ranking",
        "chat_template",
        "marker",
    }
    assert points.index("index") > max(i for i, p in enumerate(points) if p.startswith("shard:"))
    assert (
        points.index("config") < points.index("index") < points[::-1].index("marker") + len(points)
    )
    assert points[-1] == "marker"


def test_a_kill_after_any_write_point_is_finished_by_the_next_run(reference, tmp_path):
    """One folder is prepared by a chain of runs, run k killed at write point k: each run
    resumes what the one before left and writes on until its own point (never redoing a write
    that was complete). The folder is snapshotted (hard links: prepare never writes into an
    existing file) right after every kill, and each snapshot is then run to completion."""
    base, model, points = reference
    expected = tree_digest(model)
    chain = copy_base(base, tmp_path / "chain")
    snapshots = []
    for number, point in enumerate(points):
        trace = tmp_path / f"trace-{number}.txt"
        killed = _run_all([(chain, {KILL_ENV: point, TRACE_ENV: str(trace)})])
        assert killed == [-signal.SIGKILL], point
        written = trace.read_text().split()
        # The point itself, at most after redoing the one whose file was not yet renamed.
        assert written[-1] == point and len(written) <= 2, (point, written)
        if point != "marker":
            assert not (chain / PREPARED_MARKER).exists(), point
        snapshots.append(copy_base(chain, tmp_path / f"after-{number}"))
    assert _run_all([(snapshot, {}) for snapshot in snapshots]) == [0] * len(points)
    for snapshot, point in zip(snapshots, points, strict=True):
        assert tree_digest(snapshot) == expected, f"killed after {point}"

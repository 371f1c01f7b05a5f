"""bench/host_cpu.py: CPU seconds of a server's process tree, read from real processes, and the
per-step figures bench ab makes of them."""

from __future__ import annotations

import subprocess
import sys

from hyperqwen.bench.host_cpu import cpu_spent, host_cpu_rows, tree_cpu_seconds

# A grandchild does fixed work (its CPU time does not depend on how loaded the machine is),
# says so with its pid, and waits to be read.
GRANDCHILD = (
    "import os, sys; sum(i * i for i in range(3_000_000)); "
    "print(os.getpid(), flush=True); sys.stdin.read()"
)
CHILD = (
    "import subprocess, sys; "
    f"subprocess.run([sys.executable, '-c', {GRANDCHILD!r}], stdin=sys.stdin)"
)


def test_the_tree_holds_every_descendant_with_its_cpu_time() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        grandchild = int(child.stdout.readline())
        spent = tree_cpu_seconds(child.pid)
        assert set(spent) == {child.pid, grandchild}
        assert spent[grandchild] >= 0.05  # millions of multiplications, whatever the load
        assert all(seconds >= 0 for seconds in spent.values())
    finally:
        child.stdin.close()
        child.wait(timeout=60)


def test_the_busiest_process_and_the_sum_between_two_readings() -> None:
    before = {10: 1.0, 11: 2.0}
    after = {10: 1.5, 11: 4.0, 12: 0.25}  # 12 started in between: counted from zero
    assert cpu_spent(before, after) == {"busiest_cpu_s": 2.0, "total_cpu_s": 2.75}
    assert cpu_spent({}, {}) == {"busiest_cpu_s": 0.0, "total_cpu_s": 0.0}


def test_per_step_figures_scale_by_tokens_per_step() -> None:
    measured = {"requests": 4, "output_tokens": 100, "busiest_cpu_s": 0.5, "total_cpu_s": 0.8}
    rows = host_cpu_rows(measured, tokens_per_step=2.5, wall_ms_per_step=12.5)
    # 40 steps: 12.5 ms of the busiest process per step, 20 ms of all, the whole step's wall time
    assert rows == {
        "c1_host_cpu_ms_per_step": ("ms", 12.5),
        "c1_host_cpu_all_processes_ms_per_step": ("ms", 20.0),
        "c1_host_cpu_share_of_step": ("fraction", 1.0),
    }
    no_drafts = host_cpu_rows(measured, tokens_per_step=None, wall_ms_per_step=10.0)
    assert no_drafts["c1_host_cpu_ms_per_step"] == ("ms", 5.0)  # a step is one token
    assert host_cpu_rows({**measured, "output_tokens": 0}, 2.5, 12.5) == {}


def test_with_stacks_the_wait_for_the_gpu_is_left_out_of_host_work() -> None:
    runner = "GPUModelRunner._get_valid_sampled_token_count (vllm/v1/worker/gpu_model_runner.py)"
    thread = {"thread": "7", "samples": 50, "seconds": 0.5,
              "inclusive": [], "self": [[runner, 0.4], ["launch (g.py)", 0.6]]}  # fmt: skip
    stacks = {"rate_hz": 100, "processes": [{"pid": 1, "samples": 50, "threads": [thread]}]}
    measured = {"output_tokens": 100, "busiest_cpu_s": 0.5, "total_cpu_s": 0.8, "stacks": stacks}
    rows = host_cpu_rows(measured, tokens_per_step=2.5, wall_ms_per_step=12.5)
    # 40 steps: 12.5 ms of CPU a step, 40 % of the thread's 0.5 s waiting (5 ms a step)
    assert rows["c1_host_gpu_wait_ms_per_step"] == ("ms", 5.0)
    assert rows["c1_host_work_ms_per_step"] == ("ms", 7.5)
    assert rows["c1_host_work_share_of_step"] == ("fraction", 0.6)
    assert "c1_host_work_ms_per_step" not in host_cpu_rows({**measured, "stacks": None}, 2.5, 12.5)


def test_a_process_that_is_not_there_reads_as_nothing() -> None:
    assert tree_cpu_seconds(0x7FFFFFF0) == {}  # above any pid_max Linux allows

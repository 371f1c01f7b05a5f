"""`hyperqwen bench ab --turn-lock`: runs that share one GPU start their servers together and
measure one at a time, the stock half among them where it is one of the runs, and the GPU
host's recipe that starts them (bench/gpu-host/ab_together.sh). The "servers" are stand-ins
(tests/openai_test_server.py) started from real stock and patched vllm/ trees of the pinned
wheel; each test opens their start gates, so the order does not hang on how fast a loaded
machine starts them."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench_ab_fixtures import ROOT
from bench_ab_plans import RATES
from bench_ab_stand_in import stand_in_records
from cli_runner import run_in_process

from hyperqwen.bench.ab_plan import SIDES
from hyperqwen.bench.ab_run import GpuTurns
from hyperqwen.bench.results import load_result
from hyperqwen.vllm_flags import flag_value


def wait_for(condition: Callable[[], bool], what: str, limit_s: float = 300) -> None:
    """Until `condition` holds; the limit only ends a test whose condition never comes."""
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, f"no {what} after {limit_s} s"
        time.sleep(0.05)


def processes_with(variable: str) -> list[int]:
    """This user's processes whose environment holds `variable` (NAME=VALUE)."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if variable.encode() in environ.read_bytes().split(b"\0"):
                found.append(int(environ.parent.name))
        except OSError:  # gone meanwhile, or another user's
            continue
    return found


def c1_comparison(comparison: list[str], tmp_path: Path) -> list[str]:
    """A single-mode comparison of one C1 row whose stock half is kept in tmp_path/stock.json."""
    single = [*comparison, "--mode", "single", "--cohorts", "1", "--prefill", "none"]
    return [*single, "--synthetic-acceptance", RATES, "--state", str(tmp_path / "stock.json")]


@dataclass
class GatedRun:
    """A `hyperqwen bench ab` run in its own process whose stand-in server listens only once
    the test opens its gate (FAKE_START_GATE); its output so far in `early`."""

    process: subprocess.Popen
    work: Path
    gate: Path
    early: list[str] = field(default_factory=list)

    @classmethod
    def start(cls, argv: list[str], work: Path, knobs: dict[str, str]) -> GatedRun:
        gate = work.with_name(f"{work.name}.gate")
        command = [sys.executable, "-m", "hyperqwen.cli", "bench", *argv]
        command += ["--workdir", str(work), "--out", str(work / "result.json")]
        env = {**os.environ, **knobs, "FAKE_START_GATE": str(gate)}
        process = subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        return cls(process, work, gate)

    def read_until_in_line(self) -> str:
        """Its output up to the line saying it holds the turn and waits for other servers'
        starts (the last line read: all of it, if that never comes)."""
        for line in self.process.stdout:
            self.early.append(line)
            if "other server(s) still starting" in line:
                break
        return self.early[-1].strip() if self.early else ""

    def finish(self) -> str:
        """Its whole output, once it has ended; it must have succeeded."""
        output = "".join(self.early) + self.process.communicate(timeout=300)[0]
        assert self.process.returncode == 0, output
        return output

    def server_log(self, side: str) -> Path:
        return self.work / f"{side}-server.log"


def test_a_run_sharing_a_turn_lock_needs_a_fixed_kv_pool(comparison, tmp_path, capsys):
    """Servers of runs sharing a lock start together: without KV_MEM (or
    --kv-cache-memory-bytes) vLLM would count the others' memory as its own while it sizes
    the pool, so the run is refused before its server starts."""
    single = c1_comparison(comparison, tmp_path)
    assert run_in_process("bench", *single, "--phase", "stock") == 0
    capsys.readouterr()
    work = tmp_path / "variant"
    variant = [*single, "--phase", "patched", "--workdir", str(work)]
    assert run_in_process("bench", *variant, "--turn-lock", str(tmp_path / "turn")) == 2
    error = capsys.readouterr().err
    assert "--turn-lock: the patched server would size its KV cache" in error
    assert "KV_MEM=BYTES" in error and "--kv-cache-memory-bytes BYTES" in error
    assert not (work / "patched-server.log").exists()  # refused before it started


def test_runs_sharing_a_turn_lock_start_together_and_measure_one_at_a_time(
    comparison, tmp_path, capsys
) -> None:
    """Two patched variants against one saved stock half: both servers start at once; neither
    run measures before both servers are healthy, and the second only after the first has
    measured and stopped its server. The test opens each server's start gate, so the order
    does not hang on how fast a loaded machine starts either; the servers' own logs say when
    they answered what."""
    single = c1_comparison(comparison, tmp_path)
    assert run_in_process("bench", *single, "--phase", "stock") == 0
    capsys.readouterr()
    lock = tmp_path / "turn"
    variant = [*single, "--phase", "patched", "--turn-lock", str(lock)]
    runs = {
        name: GatedRun.start(variant, tmp_path / name, {**knobs, "KV_MEM": "1G"})
        for name, knobs in (("default", {}), ("novocab", {"DRAFT_VOCAB": "off"}))
    }
    # Both runs have marked their servers as starting, however late either process began ...
    wait_for(lambda: len(GpuTurns(lock).others_starting()) == 2, "two starting servers")
    # ... one server becomes healthy: its run takes the lock and waits for the other's start.
    runs["default"].gate.touch()
    in_line = runs["default"].read_until_in_line()
    assert in_line == "1 other server(s) still starting", "".join(runs["default"].early)
    runs["novocab"].gate.touch()
    for run in runs.values():
        output = run.finish()
        assert "waiting for" in output and "in line" in output
    logs = {name: run.server_log("patched") for name, run in runs.items()}
    streams = {name: stand_in_records(log, "completion") for name, log in logs.items()}
    second_healthy = stand_in_records(logs["novocab"], "healthy")[0]["at"]
    # the first run measured only once the other server was healthy, ...
    assert min(stream["arrived"] for stream in streams["default"]) > second_healthy
    # ... and the second only after the first had measured and was stopping its server
    last_of_first = max(stream["done_sent"] for stream in streams["default"])
    first_stopping = stand_in_records(logs["default"], "stopping")[0]["at"]
    assert last_of_first < first_stopping < min(stream["arrived"] for stream in streams["novocab"])
    novocab, _ = load_result(runs["novocab"].work / "result.json")
    assert "DRAFT_VOCAB=off KV_MEM=1G hyperqwen bench ab" in novocab["command"]
    default, _ = load_result(runs["default"].work / "result.json")
    assert "DRAFT_VOCAB" not in default["command"]


def test_the_stock_half_can_start_beside_a_patched_run_under_one_turn_lock(
    comparison, tmp_path
) -> None:
    """--phase stock and --phase patched started together with no saved stock half: the patched
    run measures when its turn comes (first, here), then waits for the stock run to save its
    half and writes the comparison; the stock run measures after it, with its pool fixed too."""
    single = c1_comparison(comparison, tmp_path)
    single += ["--turn-lock", str(tmp_path / "turn"), "--stock-args=--kv-cache-memory-bytes 1G"]
    runs = {
        side: GatedRun.start([*single, "--phase", side], tmp_path / side, {"KV_MEM": "1G"})
        for side in SIDES
    }
    wait_for(lambda: len(GpuTurns(tmp_path / "turn").others_starting()) == 2, "two servers")
    assert GpuTurns(tmp_path / "turn").stock_runs()  # the stock run says it is measuring
    runs["patched"].gate.touch()  # the patched server is healthy first and takes the turn
    runs["patched"].read_until_in_line()
    runs["stock"].gate.touch()
    outputs = {side: run.finish() for side, run in runs.items()}
    assert "no stock half in" in outputs["patched"]
    assert "waiting for the stock run to save its half" in outputs["patched"]
    streams = {
        side: stand_in_records(run.server_log(side), "completion") for side, run in runs.items()
    }
    patched_stopping = stand_in_records(runs["patched"].server_log("patched"), "stopping")[0]["at"]
    assert patched_stopping < min(stream["arrived"] for stream in streams["stock"])
    document, rows = load_result(tmp_path / "patched" / "result.json")
    assert {row.name for row in rows} >= {"c1_decode", "startup_to_healthy"}
    assert document["stock"]["command"][-4:-2] == ["--kv-cache-memory-bytes", "1G"]
    assert not GpuTurns(tmp_path / "turn").stock_runs()  # its marker went with its half saved
    assert not list(tmp_path.glob(".stock.json.*.partial"))


def test_a_patched_run_under_a_turn_lock_with_no_stock_half_nor_stock_run_is_refused(
    comparison, tmp_path, capsys, monkeypatch
) -> None:
    """No saved half and no --phase stock run under the lock within the grace: refused before
    its server starts, naming what to run."""
    monkeypatch.setattr("hyperqwen.bench.ab.STOCK_RUN_GRACE_S", 0.0)
    single = c1_comparison(comparison, tmp_path)
    variant = [*single, "--phase", "patched", "--turn-lock", str(tmp_path / "turn")]
    monkeypatch.setenv("KV_MEM", "1G")
    assert run_in_process("bench", *variant) == 2
    assert "no such file; run --phase stock first" in capsys.readouterr().err
    assert not (tmp_path / "work" / "patched-server.log").exists()


def test_the_gpu_host_recipe_starts_stock_and_variants_together(comparison, tmp_path) -> None:
    """bench/gpu-host/ab_together.sh as the GPU host runs it (its env.sh replaced by one naming
    this test's trees): the stock half and two variants started together under one turn lock,
    each variant's result against that stock half, the variants named, the logs kept."""
    host = tmp_path / "host"
    (host / "bench" / "gpu-host").mkdir(parents=True)
    for script in ("ab_together.sh", "host_state.sh"):
        recipe = ROOT / "bench" / "gpu-host" / script
        (host / "bench" / "gpu-host" / script).write_bytes(recipe.read_bytes())
    model, stock_tree, patched_tree = comparison[1], comparison[3], comparison[5]
    (host / "bench" / "gpu-host" / "env.sh").write_text(
        f"export R={shlex.quote(str(tmp_path / 'R'))}"
        f" HYPERQWEN_STOCK_VLLM={shlex.quote(stock_tree)}"
        f" HYPERQWEN_PATCHED_VLLM={shlex.quote(patched_tree)}\n"
    )
    # what the recipe does not set itself: the stand-in servers, the env file, the workload
    taken = {"--stock-vllm", "--patched-vllm", "--workdir"}
    options, rest = [], iter(comparison[2:])
    for word in rest:
        if word in taken:
            next(rest)
        elif not word.startswith("--vllm-args="):
            options.append(word)
    options += ["--mode", "single", "--cohorts", "1", "--prefill", "none"]
    options += ["--synthetic-acceptance", RATES]
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "AB_MODEL": model,
        "AB_STOCK_MODEL": model,
        "AB_KV_MEM": "1G",
        "AB_STOCK_ENV": "VLLM_USE_V2_MODEL_RUNNER=1",
    }
    command = [
        "bash",
        "bench/gpu-host/ab_together.sh",
        "t",
        shlex.join(options),
        "",
        "DRAFT_VOCAB=off",
    ]
    done = subprocess.run(command, cwd=host, env=env, capture_output=True, text=True, timeout=600)
    out = tmp_path / "R" / "t"
    logs = "\n".join(f"== {log.name}\n{log.read_text()}" for log in sorted(out.glob("*.log")))
    assert done.returncode == 0, done.stdout + done.stderr + logs
    assert (out / "variants.txt").read_text().splitlines() == [
        "stock: env VLLM_USE_V2_MODEL_RUNNER=1; flags (none)",
        "v1: the profile defaults",
        "v2: DRAFT_VOCAB=off",
    ]
    assert "saved the stock half" in (out / "stock.log").read_text()
    stock_command = None
    for index, knob in ((1, None), (2, "DRAFT_VOCAB=off")):
        document, rows = load_result(out / f"v{index}.json")
        assert "c1_decode" in {row.name for row in rows}
        # the pool fixed, stock serves the profile's streams (vLLM's default would not start)
        streams = flag_value(document["patched"]["command"], "--max-num-seqs")
        assert document["stock"]["command"][-6:] == [
            *("--gpu-memory-utilization", "0.30", "--kv-cache-memory-bytes", "1G"),
            *("--max-num-seqs", streams),
        ]
        assert any(f"profile's {streams} streams" in note for note in document["notes"])
        stock_command = stock_command or document["stock"]["command"]
        assert document["stock"]["command"] == stock_command  # one stock half for both
        assert (knob in document["command"]) if knob else "DRAFT_VOCAB" not in document["command"]
        assert "--additional-config" in document["patched"]["command"]
    assert {"stock-stock-server.log", "v1-patched-server.log"} <= {p.name for p in out.iterdir()}
    for moment in ("start", "end"):  # what else the host ran, beside the measurement
        assert "load average" in (out / f"host-state-{moment}.txt").read_text()

    # A later run takes that stock half instead of serving stock again: the GPU is the variants'
    half = out / "stock-half.json"
    again = [*command[:2], "t2", *command[3:4], "PREFIX_CACHE=0"]
    done = subprocess.run(
        again,
        cwd=host,
        env={**env, "AB_STOCK_HALF": str(half)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = tmp_path / "R" / "t2"
    logs = "\n".join(f"== {log.name}\n{log.read_text()}" for log in sorted(out.glob("*.log")))
    assert done.returncode == 0, done.stdout + done.stderr + logs
    assert (out / "variants.txt").read_text().splitlines() == [
        f"stock: the half saved in {half}",
        "v1: PREFIX_CACHE=0",
    ]
    assert not (out / "stock.log").exists() and not (out / "stock-half.json").exists()
    document, rows = load_result(out / "v1.json")
    assert document["stock"]["command"] == stock_command
    assert flag_value(document["patched"]["command"], "--gpu-memory-utilization") == "0.9"
    assert "c1_decode" in {row.name for row in rows}

    # Every variant refused (15 drafts, 3 rates): the stock half, whose stand-in never gets
    # healthy here, is stopped with its server instead of running out its start.
    gate = tmp_path / "never-opened"
    stopped = [*command[:2], "t3", *command[3:4], "DRAFT_TOKENS=15"]
    refused_env = {**env, "AB_STOCK_ENV": f"FAKE_START_GATE={gate}"}
    done = subprocess.run(stopped, cwd=host, env=refused_env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    out = tmp_path / "R" / "t3"
    assert done.returncode == 1, done.stdout + done.stderr
    assert "must have length 15" in (out / "v1.log").read_text()
    assert (out / "variants.txt").read_text().splitlines()[-1] == (
        "stock: stopped, as no variant was measured"
    )
    assert "healthy" not in (out / "stock.log").read_text()
    assert not processes_with(f"FAKE_START_GATE={gate}"), "the stock server outlived its run"

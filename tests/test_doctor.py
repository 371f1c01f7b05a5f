"""`hyperqwen doctor` on this CPU-only machine, and each check against real inputs."""

from __future__ import annotations

import json
import os
from pathlib import Path

from cli_runner import ROOT, hyperqwen

from hyperqwen import doctor
from hyperqwen.gpu import NoGpu, parse_smi_line, visible_to_cuda
from hyperqwen.prepare.marker import PREPARED_MARKER
from hyperqwen.settings import LoadedSettings, Settings


def doctor_with_vllm(vllm_dir: Path, tmp_path: Path):
    """`hyperqwen doctor` in a Python that imports vLLM from `vllm_dir` (first on its path)."""
    env = {
        "MODELS_DIR": str(tmp_path / "models"),
        "PYTHONPATH": os.pathsep.join([str(vllm_dir.parent), str(ROOT / "src")]),
    }
    return hyperqwen("doctor", env=env, cwd=tmp_path)


def test_doctor_explains_a_cpu_only_machine(tmp_path, patched_vllm):
    result = doctor_with_vllm(patched_vllm, tmp_path)
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    assert any(line.startswith("OK    python") for line in lines)
    assert any(line.startswith("OK    vllm       0.26.0") for line in lines)
    assert any(
        line.startswith("OK    patches") and line.endswith("patches of the series applied")
        for line in lines
    )
    gpu = next(i for i, line in enumerate(lines) if line.startswith("FAIL  gpu"))
    assert "nvidia-smi not found" in lines[gpu]
    assert "fix: serving needs an NVIDIA GPU" in lines[gpu + 1]
    assert any(line.startswith("FAIL  model") for line in lines)
    assert any("hyperqwen prepare" in line for line in lines)
    assert any(line.startswith("OK    access     bind 127.0.0.1, no key") for line in lines)
    assert lines[-1] == "FAIL above: fix those before serving"


def test_doctor_names_the_command_that_patches_a_pristine_vllm(tmp_path, pristine_vllm_dir):
    lines = doctor_with_vllm(pristine_vllm_dir, tmp_path).stdout.splitlines()
    patches = next(i for i, line in enumerate(lines) if line[6:13] == "patches")
    assert lines[patches].startswith("FAIL  patches") and "not applied" in lines[patches]
    assert "fix: hyperqwen patches apply" in lines[patches + 1]


def test_doctor_reports_bad_settings(tmp_path):
    result = hyperqwen("doctor", env={"CTX": "enormous"}, cwd=tmp_path)
    assert result.returncode == 1
    assert "FAIL  settings   CTX='enormous' is not valid" in result.stdout


def test_python_versions():
    assert doctor.check_python((3, 12)).status == "OK"
    assert doctor.check_python((3, 10)).status == "FAIL"
    assert doctor.check_python((3, 13)).status == "FAIL"


def test_gpu_lines_from_nvidia_smi_output():
    rows = {
        "h200": "0, NVIDIA H200, 9.0, 143771, 580.95.05, 700.00",
        "3090": "1, NVIDIA GeForce RTX 3090, 8.6, 24576, 575.57.08, 350.00",
        "3060": "2, NVIDIA GeForce RTX 3060, 8.6, 12288, 575.57.08, [N/A]",
        "t4": "3, Tesla T4, 7.5, 15360, 535.1, 70.00",
    }
    checks = doctor.check_gpu(lambda: [parse_smi_line(row) for row in rows.values()])
    assert [c.status for c in checks] == ["OK", "OK", "WARN", "FAIL"]
    assert "sm86, 24.0 GiB" in checks[1].detail
    assert [parse_smi_line(row).power_limit for row in rows.values()] == [
        "700.00 W",
        "350.00 W",
        "[N/A]",
        "70.00 W",
    ]
    assert "8.0" in checks[3].fix

    def no_gpu():
        raise NoGpu("nvidia-smi lists no GPU")

    (check,) = doctor.check_gpu(no_gpu)
    assert check.status == "FAIL" and "nvidia-smi lists no GPU" in check.detail


def test_model_folder_states(tmp_path):
    loaded = LoadedSettings(Settings(MODELS_DIR=tmp_path, MODEL="m"), frozenset())
    model, disk = doctor.check_model(loaded)
    assert model.status == "FAIL" and "hyperqwen prepare" in model.fix
    assert disk.detail.endswith(f"free at {tmp_path}")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    assert doctor.check_model(loaded)[0].status == "WARN"
    (tmp_path / "m" / PREPARED_MARKER).write_text(json.dumps({"steps": []}))
    assert doctor.check_model(loaded)[0].status == "OK"


def test_exposure_posture(tmp_path):
    open_host = LoadedSettings(
        Settings(HOST="0.0.0.0", API_KEY_FILE=tmp_path / "k"), frozenset({"HOST"})
    )
    check = doctor.check_exposure(open_host, in_container=False)
    assert check.status == "WARN" and "WITHOUT an API key" in check.fix
    (tmp_path / "k").write_text("secret-key\n")
    check = doctor.check_exposure(open_host, in_container=False)
    assert check.status == "OK" and "secret" not in check.detail
    assert check.detail == f"bind 0.0.0.0, key set ({tmp_path / 'k'})"
    published = LoadedSettings(
        Settings(BIND="0.0.0.0", API_KEY_FILE=tmp_path / "none"), frozenset({"BIND"})
    )
    assert doctor.check_exposure(published, in_container=True).status == "WARN"


def test_only_the_gpus_cuda_visible_devices_leaves_are_reported() -> None:
    gpus = [
        parse_smi_line(f"{index}, NVIDIA H200, 9.0, 143771, 580.159.04, 700.00")
        for index in range(3)
    ]
    assert visible_to_cuda(gpus, None) == gpus
    assert [gpu.index for gpu in visible_to_cuda(gpus, "1")] == [1]
    assert [gpu.index for gpu in visible_to_cuda(gpus, "2,0")] == [2, 0]
    assert [gpu.index for gpu in visible_to_cuda(gpus, "0,7,1")] == [0]  # CUDA stops at 7
    assert visible_to_cuda(gpus, "") == []
    assert visible_to_cuda(gpus, "GPU-5c7b1e2a") == gpus  # UUIDs: not mapped, all kept


def test_the_plugin_line_says_whether_vllm_will_load_it():
    installed = doctor.check_plugin()  # this venv installs the package: its entry point is there
    assert installed.status == "OK" and "hyperqwen.vllm_plugin:register" in installed.detail
    source_only = doctor.check_plugin(lambda: False)
    assert source_only.status == "WARN" and "KV=kvarn" in source_only.detail
    assert "pip install -e ." in source_only.fix


def test_the_fit_line_says_what_each_mode_gets_on_the_card(tmp_path):
    """A 24 GB card beside the 27B: each mode's profile as the launcher sizes it, and a knob
    the card cannot hold as serve would refuse it, by name."""
    rtx_3090 = [parse_smi_line("1, NVIDIA GeForce RTX 3090, 8.6, 24576, 575.57.08, 350.00")]
    loaded = LoadedSettings(Settings(MODELS_DIR=tmp_path), frozenset())
    single, batch = doctor.check_fit(loaded, lambda: rtx_3090)
    assert single.status == batch.status == "OK"
    assert single.detail.startswith("single, CTX=fast: this card holds ")
    assert "tokens at 1 slot" in single.detail and "NVIDIA GeForce RTX 3090" in single.detail
    assert batch.detail.startswith("batch: this card holds ")
    too_long = LoadedSettings(Settings(MODELS_DIR=tmp_path, MAX_LEN=200_000), frozenset())
    checks = doctor.check_fit(too_long, lambda: rtx_3090)
    assert [check.status for check in checks] == ["FAIL", "FAIL"]
    assert all("MAX_LEN=200000 does not fit" in check.detail for check in checks)
    turboquant = LoadedSettings(Settings(MODELS_DIR=tmp_path, KV="turboquant_4bit_nc"), frozenset())
    single, batch = doctor.check_fit(turboquant, lambda: rtx_3090)
    assert single.status == "FAIL" and "cannot serve with SPEC=mtp" in single.detail
    assert batch.status == "OK"  # batch does not speculate

    def no_gpu():
        raise NoGpu("nvidia-smi lists no GPU")

    assert doctor.check_fit(loaded, no_gpu) == []


def test_the_fit_line_fails_where_serve_would_refuse_before_vllm_starts(tmp_path):
    """The knobs `hyperqwen serve` refuses for these cards or this model folder
    (launch.start_refusal) fail doctor's fit line by name, mode by mode."""
    rtx_3090 = [parse_smi_line("1, NVIDIA GeForce RTX 3090, 8.6, 24576, 575.57.08, 350.00")]

    def fit(**knobs):
        settings = Settings(MODELS_DIR=tmp_path, **knobs)
        return doctor.check_fit(LoadedSettings(settings, frozenset(knobs)), lambda: rtx_3090)

    single, batch = fit(INDUCTOR_PDL="1")  # Inductor emits PDL on sm90 and newer only
    assert single.status == batch.status == "FAIL"
    assert "INDUCTOR_PDL=1 needs compute capability 9.0" in single.detail
    single, batch = fit(DRAFT_HEAD_INT8="1")  # the model folder has no prepared draft head
    assert single.status == "FAIL" and "DRAFT_HEAD_INT8=1 needs the draft head" in single.detail
    assert batch.status == "OK"  # batch mode does not draft

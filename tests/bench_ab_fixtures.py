"""The fixtures of a `hyperqwen bench ab` comparison between a stock and a patched vllm/ tree
of the pinned wheel, served by stand-ins (tests/openai_test_server.py), shared by the
test_bench_ab*.py files. tests/conftest.py registers them, so this module imports nothing heavy
(no torch); series_dir and vllm_trees are module-scoped: one tree pair per test module."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm_trees import copy_vllm_tree

from hyperqwen.patches.series import SERIES_DIR_ENV, load_series, series_names
from hyperqwen.patches.tree import apply_series

ROOT = Path(__file__).resolve().parents[1]
TEST_SERVER = ROOT / "tests" / "openai_test_server.py"
BEHAVIOUR = {
    "stock": {
        "startup_s": 0.2,
        "weight_gib": 14.0,
        "prefill_ms": 50,
        "step_ms": 20,
        "prompt_logprob": -0.5,
        "kernels_us": {"void machete::Kernel<int4>(...)": 400.0, "rms_norm_kernel": 50.0},
    },
    "patched": {
        "startup_s": 2.0,
        "weight_gib": 13.0,
        "prefill_ms": 50,
        "step_ms": 16,
        "prompt_logprob": -0.52,
        "kernels_us": {"void marlin::Marlin<...>(...)": 300.0, "rms_norm_kernel": 50.0},
    },
}


@pytest.fixture(scope="module")
def series_dir(tmp_path_factory) -> Iterator[Path]:
    """The committed series alone (diffs being written beside it are left out), for both the
    test and `bench ab` (through $HYPERQWEN_PATCHES_DIR)."""
    folder = tmp_path_factory.mktemp("series")
    shutil.copyfile(ROOT / "patches" / "series", folder / "series")
    for patch in series_names(ROOT / "patches" / "series"):
        shutil.copyfile(ROOT / "patches" / patch, folder / patch)
    with pytest.MonkeyPatch.context() as patch_env:
        patch_env.setenv(SERIES_DIR_ENV, str(folder))
        yield folder


@pytest.fixture(scope="module")
def vllm_trees(pristine_vllm_dir: Path, series_dir: Path, tmp_path_factory) -> tuple[Path, Path]:
    """(stock parent, patched parent): the wheel's vllm/ as is, and a copy with the series."""
    patched = tmp_path_factory.mktemp("patched-vllm") / "vllm"
    copy_vllm_tree(pristine_vllm_dir, patched)
    apply_series(load_series(series_dir), patched)
    return pristine_vllm_dir.parent, patched.parent


@pytest.fixture
def comparison(tmp_path, vllm_trees) -> list[str]:
    """The options every comparison below shares: model, trees, test servers, workdir."""
    model = tmp_path / "synth-27b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["Qwen3_5ForCausalLM"]}))
    (tmp_path / "empty.env").write_text("")
    (tmp_path / "fake.json").write_text(json.dumps(BEHAVIOUR))
    server = f"{{python}} {TEST_SERVER} --fake-config {tmp_path / 'fake.json'} --side {{side}}"
    return [
        "ab",
        str(model),
        "--stock-vllm",
        str(vllm_trees[0]),
        "--patched-vllm",
        str(vllm_trees[1]),
        "--env-file",
        str(tmp_path / "empty.env"),
        "--workdir",
        str(tmp_path / "work"),
        "--server-command",
        server + " {args}",
        "--vllm-args=--load-format dummy --max-model-len 4096",
        "--input-len",
        "64",
        "--output-len",
        "48",
        "--rounds",
        "1",
        "--prefill-requests",
        "1",
        "--startup-timeout",
        "60",
    ]

"""Shared fixtures: a pristine vLLM tree unpacked from the pinned wheel.

Without a CUDA GPU, Triton kernels run in Triton's interpreter (NumPy on the CPU), so kernel
tests check the same kernel source in CI. Triton reads TRITON_INTERPRET when each @triton.jit
function is defined, its own library's included, so it is set here, before anything imports it.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

if not Path("/dev/nvidia0").exists() and not os.environ.get("CUDA_VISIBLE_DEVICES"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

# The comparison fixtures of the test_bench_ab*.py files, registered here so that they share them.
from bench_ab_fixtures import comparison, series_dir, vllm_trees  # noqa: F401
from vllm_trees import copy_vllm_tree

from hyperqwen.patches.tree import series_status
from hyperqwen.settings import PINNED_VLLM


def wheel_cache_dir() -> Path:
    """Downloaded wheels live in $HYPERQWEN_CACHE/wheels (default ~/.cache/hyperqwen/wheels)."""
    return Path(os.environ.get("HYPERQWEN_CACHE", "~/.cache/hyperqwen")).expanduser() / "wheels"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """GPU tests start real servers and run benchmarks and soaks for as long as they are told
    (HYPERQWEN_SOAK_MINUTES); each wait in them has its own limit, so the CPU suite's per-test
    timeout (pyproject.toml) is lifted for them."""
    for item in items:
        if item.get_closest_marker("gpu") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(0))


@pytest.fixture(scope="session")
def interpreted() -> None:
    """For CPU kernel tests: skips them where Triton compiles for a GPU instead (this file turns
    the interpreter on only without one; the *_gpu.py tests run there)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU test: this machine has a GPU (the *_gpu.py tests run there)")


@pytest.fixture(scope="module")
def vllm_cpu_platform() -> Iterator[None]:
    """vLLM's CPU platform as its current one for a test module (vLLM's argument defaults and
    configs ask for a device; with no GPU it would pick none), the one before restored after.
    vLLM modules first imported meanwhile keep the CPU platform they imported."""
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(platforms, "_current_platform", CpuPlatform())
        yield


@pytest.fixture(scope="module")
def vllm_serve(vllm_cpu_platform):
    """vLLM's real `vllm serve` parser and validator, built on the CPU platform.

    The launcher targets the patched vLLM (e.g. --sse-keep-alive-interval comes from the
    series), so the importable vLLM must have the series applied, as install.sh does.
    """
    applied, detail = series_status()
    if not applied:
        pytest.fail(
            f"the vLLM this Python imports is not patched ({detail}): "
            "run `hyperqwen patches apply` (install.sh does)"
        )
    from vllm.entrypoints.cli import serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm")
    subparsers = parser.add_subparsers(dest="subparser")
    (command,) = serve.cmd_init()
    command.subparser_init(subparsers)

    def parse(argv: list[str]):
        assert argv[0] == "vllm"
        args = parser.parse_args(argv[1:])
        command.validate(args)
        return args

    parse.parser = parser
    return parse


@pytest.fixture(scope="session")
def vllm_wheel() -> Path:
    """The pinned vLLM wheel, downloaded once (no dependencies) and reused from the cache. One
    process downloads at a time, into a staging folder renamed into place: pytest-xdist's
    workers all ask for it at once on a clean machine, and none may read a half-written wheel."""
    cache = wheel_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    pattern = f"vllm-{PINNED_VLLM}-*.whl"
    with open(cache / ".download.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not any(cache.glob(pattern)):
            staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=cache))
            try:
                download_vllm_wheel(staging)
                for wheel in staging.glob(pattern):
                    wheel.rename(cache / wheel.name)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    return sorted(cache.glob(pattern))[-1]


def download_vllm_wheel(folder: Path) -> None:
    """pip's download of the pinned vLLM wheel into FOLDER, or the test fails saying why."""
    command = [sys.executable, "-m", "pip", "download", f"vllm=={PINNED_VLLM}"]
    done = subprocess.run(
        [*command, "--no-deps", "-d", str(folder)],
        capture_output=True,
        text=True,
        check=False,
        timeout=900,  # a 0.5 GB wheel
    )
    if done.returncode != 0:
        pytest.fail(
            f"could not download vllm=={PINNED_VLLM} into {folder.parent} (needs PyPI access, "
            f"or put the wheel there by hand):\n{done.stderr[-2000:]}"
        )


@pytest.fixture(scope="session")
def pristine_vllm_dir(vllm_wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel's vllm/ package, unpacked once per session. Read it, never write it."""
    root = tmp_path_factory.mktemp("pristine-vllm")
    with zipfile.ZipFile(vllm_wheel) as wheel:
        wheel.extractall(root, members=[n for n in wheel.namelist() if n.startswith("vllm/")])
    return root / "vllm"


@pytest.fixture
def vllm_tree_copy(pristine_vllm_dir: Path, tmp_path: Path) -> Path:
    """A private, writable copy of the pristine vllm/ package (its parent is a fresh folder)."""
    return copy_vllm_tree(pristine_vllm_dir, tmp_path / "site-packages" / "vllm")


@pytest.fixture(scope="session")
def patched_vllm(pristine_vllm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the pristine tree with the repository's whole series applied. Read it (import
    it in a subprocess), never write it: several test modules share it."""
    from hyperqwen.patches.series import load_series
    from hyperqwen.patches.tree import apply_series

    target = tmp_path_factory.mktemp("series-patched") / "vllm"
    copy_vllm_tree(pristine_vllm_dir, target)
    apply_series(load_series(Path(__file__).resolve().parents[1] / "patches"), target)
    return target


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Config, tokenizer and chat template of a tiny Qwen3.5 model (no weights)."""
    from hyperqwen.checkpoint.geometry import PRESETS
    from hyperqwen.checkpoint.synthesize import synthesize

    target = tmp_path_factory.mktemp("tiny-qwen") / "checkpoint"
    return synthesize(target, PRESETS["tiny"], config_only=True, progress=False).directory


@pytest.fixture(scope="session")
def api_patches_report(
    patched_vllm: Path,
    pristine_vllm_dir: Path,
    tiny_checkpoint: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict:
    """What the patched vLLM OpenAI app does, gathered once (minutes) in one subprocess for the
    three test_api_patches*.py files (tests/api_patches_report.py)."""
    from api_patches_report import build_report

    return build_report(
        patched_vllm, pristine_vllm_dir, tiny_checkpoint, tmp_path_factory.mktemp("api-report")
    )


@pytest.fixture(scope="module")
def tiny_models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """GPU tests: a MODELS_DIR holding `tiny`, config and tokenizer only (served with
    --load-format dummy)."""
    from gpu_server import require_gpu

    from hyperqwen.checkpoint.geometry import PRESETS
    from hyperqwen.checkpoint.synthesize import synthesize

    require_gpu()
    root = tmp_path_factory.mktemp("models")
    synthesize(root / "tiny", PRESETS["tiny"], config_only=True, progress=False)
    return root


@pytest.fixture
def engine_log(caplog):
    """caplog for the engine's loggers ("vllm.hyperqwen.*") at INFO: once vLLM has set up its
    logging its "vllm" logger stops propagation, so caplog's root handler alone would miss
    them, depending on whether an earlier test imported vLLM. vLLM's logging is set up first
    (its import reconfigures the loggers), so a test that imports vLLM keeps this handler.
    The handler's level is set too: importing vLLM's API server (its dependency
    model_hosting_container_standards) sets the root logger to ERROR for the whole process,
    and caplog's handlers follow the root's level from then on."""
    import vllm.logger  # noqa: F401

    logger = logging.getLogger("vllm.hyperqwen")
    propagate = logger.propagate
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="vllm.hyperqwen")  # restored after the test
    logger.propagate = False  # caught here once, not again at the root
    yield caplog
    logger.removeHandler(caplog.handler)
    logger.propagate = propagate

"""One Triton cache for every configuration (engine/shared_triton_cache.py): vLLM's own Inductor
adaptors, patched with the compile_cache_initialized seam (patches/compile-cache-dirs.patch),
leave TRITON_CACHE_DIR at VLLM_CACHE_ROOT/triton_cache while TRITON_CACHE is shared, at vLLM's
folder while it is off, and untouched with the compile cache disabled; the knob reaches the
engine's variable and a value it does not take is refused by name."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from loaded_settings import loaded

from hyperqwen.engine.features import SHARED_TRITON_CACHE
from hyperqwen.launch import build_launch
from hyperqwen.patches.tree import series_status
from hyperqwen.settings import SettingsError, load_settings

PREFIX = "backbone"


@pytest.fixture
def adaptors(vllm_cpu_platform):
    """vLLM's two Inductor adaptors, from the patched vLLM this Python imports."""
    from vllm.compilation.compiler_interface import InductorAdaptor, InductorStandaloneAdaptor

    applied, detail = series_status()
    assert applied, f"the importable vLLM is not patched ({detail}): hyperqwen patches apply"
    return {
        "standalone": lambda: InductorStandaloneAdaptor("binary"),
        "inductor": InductorAdaptor,
    }


@pytest.fixture
def folders(tmp_path, monkeypatch) -> tuple[Path, Path]:
    """(VLLM_CACHE_ROOT, this configuration's compile cache folder), TRITON_CACHE_DIR unset;
    monkeypatch restores the environment vLLM's adaptors change."""
    root = tmp_path / "vllm-cache"
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(root))
    for variable in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", SHARED_TRITON_CACHE.env):
        monkeypatch.delenv(variable, raising=False)
    return root, root / "torch_compile_cache" / "0123456789" / "rank_0_0" / PREFIX


def initialize(adaptor, cache_dir: Path, disable_cache: bool) -> None:
    adaptor.initialize_cache(str(cache_dir), disable_cache=disable_cache, prefix=PREFIX)


@pytest.mark.parametrize("kind", ["standalone", "inductor"])
@pytest.mark.parametrize("value", [None, "shared"])
def test_shared_points_triton_at_one_folder_under_the_vllm_cache_root(
    adaptors, folders, monkeypatch, kind, value
):
    root, cache_dir = folders
    if value is not None:
        monkeypatch.setenv(SHARED_TRITON_CACHE.env, value)
    initialize(adaptors[kind](), cache_dir, disable_cache=False)
    shared = root / "triton_cache"
    assert os.environ["TRITON_CACHE_DIR"] == str(shared) and shared.is_dir()


def test_off_keeps_vllms_folder_of_the_configuration(adaptors, folders, monkeypatch):
    root, cache_dir = folders
    monkeypatch.setenv(SHARED_TRITON_CACHE.env, "off")
    initialize(adaptors["inductor"](), cache_dir, disable_cache=False)
    # InductorAdaptor's: the compile cache of the config hash, without the prefix
    assert os.environ["TRITON_CACHE_DIR"] == str(cache_dir.parent / "triton_cache")
    initialize(adaptors["standalone"](), cache_dir, disable_cache=False)
    assert os.environ["TRITON_CACHE_DIR"] == str(cache_dir.parent / "triton_cache")
    assert not (root / "triton_cache").exists()


@pytest.mark.parametrize("kind", ["standalone", "inductor"])
def test_a_disabled_compile_cache_changes_nothing(adaptors, folders, monkeypatch, kind):
    root, cache_dir = folders
    monkeypatch.setenv("TRITON_CACHE_DIR", "/the/users/triton")
    initialize(adaptors[kind](), cache_dir, disable_cache=True)
    assert os.environ["TRITON_CACHE_DIR"] == "/the/users/triton"
    assert not root.exists()


@pytest.mark.parametrize("mode", ["single", "batch"])
def test_the_knob_reaches_the_engine_env_in_both_modes(mode):
    assert SHARED_TRITON_CACHE.env not in build_launch(loaded(), mode, None).env  # unset: shared
    assert SHARED_TRITON_CACHE.state(None) == "shared"
    plan = build_launch(loaded(TRITON_CACHE="off"), mode, None)
    assert plan.env[SHARED_TRITON_CACHE.env] == "off"
    assert SHARED_TRITON_CACHE.env not in " ".join(plan.argv)


def test_a_value_it_does_not_take_is_refused_by_name():
    with pytest.raises(SettingsError) as error:
        load_settings({"TRITON_CACHE": "per-config"}, Path("/nonexistent"))
    assert str(error.value).startswith("TRITON_CACHE='per-config' is not valid")
    assert "Allowed: shared | off" in str(error.value)

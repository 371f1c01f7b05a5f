"""HyperQwen's vLLM general plugin (src/hyperqwen/vllm_plugin.py), loaded the way vLLM 0.26
loads it: `vllm.plugins.load_general_plugins()` in a fresh process, the entry point found through
package metadata written from pyproject.toml's declaration (first on the path, so it is the one
under test whatever the venv's install of hyperqwen declares)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from cli_runner import ROOT
from gpu_server import write_plugin_metadata

from hyperqwen.engine.features import (
    FEATURES,
    GDN_BA,
    KVARN,
    ON,
    FeatureSwitchError,
    check_environment,
)
from hyperqwen.vllm_plugin import ENV_PREFIX, register

GROUP = "vllm.general_plugins"
PROBE = """
import json, sys
from importlib.metadata import entry_points
import vllm.plugins
found = sorted(plugin.value for plugin in entry_points(group="vllm.general_plugins"))
vllm.plugins.load_general_plugins()
print(json.dumps({"found": found, "hyperqwen": sorted(m for m in sys.modules if "hyperqwen" in m)}))
"""


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory) -> Path:
    """A folder holding hyperqwen's distribution metadata with pyproject's entry points."""
    return write_plugin_metadata(tmp_path_factory.mktemp("plugin-metadata"))


# after the plugins: what vLLM's registry resolves its CUSTOM attention backend to
CUSTOM_PROBE = """
from vllm.v1.attention.backends.registry import AttentionBackendEnum as Backends
custom = Backends.CUSTOM
resolved = custom.get_class() if custom.is_overridden() else None
print(json.dumps({"custom": resolved and f"{resolved.__module__}.{resolved.__qualname__}",
                  "name": resolved and resolved.get_name()}))
"""


def load_plugins(
    plugin_path: Path, probe: str = PROBE, **variables: str
) -> subprocess.CompletedProcess:
    """vLLM's plugin loading in a process whose HyperQwen variables are exactly `variables`."""
    env = {name: value for name, value in os.environ.items() if not name.startswith(ENV_PREFIX)}
    env.pop("VLLM_PLUGINS", None)
    env["PYTHONPATH"] = os.pathsep.join([str(plugin_path), str(ROOT / "src")])
    return subprocess.run([sys.executable, "-c", probe], env={**env, **variables},
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def test_pyproject_declares_the_plugin():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"][GROUP] == {"hyperqwen": "hyperqwen.vllm_plugin:register"}


def test_without_a_hyperqwen_variable_it_imports_and_changes_nothing(plugin_path):
    """The stock side of `bench ab`: vLLM loads the plugin, which imports no engine module."""
    done = load_plugins(plugin_path)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert "hyperqwen.vllm_plugin:register" in report["found"]
    assert report["hyperqwen"] == ["hyperqwen", "hyperqwen.vllm_plugin"]


def test_a_bad_engine_value_stops_vllm_before_the_model_loads_naming_it(plugin_path):
    done = load_plugins(plugin_path, **{GDN_BA.env: "yes"})
    assert done.returncode != 0
    assert f"FeatureSwitchError: {GDN_BA.env}='yes': expected one of 0, 1" in done.stderr
    assert GDN_BA.knob in done.stderr


def test_good_engine_values_pass_and_load_only_the_declarations(plugin_path):
    """The check reads the declarations only: no feature module (and no kernel) is imported."""
    done = load_plugins(plugin_path, **{GDN_BA.env: "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["hyperqwen"] == [
        "hyperqwen",
        "hyperqwen.engine",
        "hyperqwen.engine.feature_model",
        "hyperqwen.engine.features",
        "hyperqwen.engine.features_gdn",
        "hyperqwen.engine.features_kv",
        "hyperqwen.engine.features_lookup",
        "hyperqwen.vllm_plugin",
    ]


@pytest.mark.parametrize("kvarn", [None, "0", "1"])
def test_the_kvarn_backend_is_registered_as_vllms_custom_one_only_when_asked(plugin_path, kvarn):
    """HYPERQWEN_KV_KVARN=1 (KV=kvarn): vLLM's registry resolves CUSTOM, the backend
    `--attention-backend CUSTOM` selects, to KVarN's class, which vLLM's Attention layer finds
    again by its name; unset or 0: nothing registered, no KVarN module imported."""
    variables = {} if kvarn is None else {KVARN.env: kvarn}
    done = load_plugins(plugin_path, PROBE + CUSTOM_PROBE, **variables)
    assert done.returncode == 0, done.stderr[-3000:]
    # the probes' two lines of JSON (importing the backend may log to stdout between them)
    reports = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    modules, registry = reports[-2:]
    if kvarn == ON:
        assert registry == {"custom": "hyperqwen.kvarn.backend.KVarNBackend", "name": "CUSTOM"}
    else:
        assert registry == {"custom": None, "name": None}
        assert not [m for m in modules["hyperqwen"] if "kvarn" in m]


def test_vllm_plugins_can_leave_it_out(plugin_path):
    done = load_plugins(plugin_path, VLLM_PLUGINS="someone_else", **{GDN_BA.env: "yes"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1])["hyperqwen"] == []


def test_every_engine_variable_carries_the_prefix_the_plugin_looks_for():
    assert all(feature.env.startswith(ENV_PREFIX) for feature in FEATURES)


@pytest.mark.parametrize("feature", FEATURES, ids=lambda f: f.name)
def test_each_features_bad_value_is_refused_by_name(monkeypatch, feature):
    for other in FEATURES:
        monkeypatch.delenv(other.env, raising=False)
    register()  # nothing set: nothing to refuse
    for value in feature.values:
        monkeypatch.setenv(feature.env, value)
        register()
    monkeypatch.setenv(feature.env, "maybe")
    with pytest.raises(FeatureSwitchError, match=f"{feature.env}='maybe'"):
        register()
    with pytest.raises(FeatureSwitchError, match=feature.knob):
        check_environment()


REFUSAL_PROBE = """
import json, sys
from hyperqwen.vllm_plugin import unregistered_plugin_refusal
print(json.dumps([unregistered_plugin_refusal(env) for env in json.loads(sys.argv[1])]))
"""


def plugin_refusals(envs: list[dict], *folders: Path) -> list[str | None]:
    """unregistered_plugin_refusal in a Python without site-packages, which sees the package
    only through `folders`: a source folder alone (as on a host that only sets PYTHONPATH), or
    beside the distribution metadata pip would write."""
    done = subprocess.run(
        [sys.executable, "-S", "-c", REFUSAL_PROBE, json.dumps(envs)],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(map(str, folders))},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_serving_a_registered_feature_without_the_entry_point_is_refused(tmp_path, plugin_path):
    source_only = tmp_path / "source-only"
    source_only.mkdir()
    (source_only / "hyperqwen").symlink_to(ROOT / "src" / "hyperqwen")
    envs = [{KVARN.env: ON}, {KVARN.env: "0"}, {}]
    kvarn, off, none = plugin_refusals(envs, source_only)
    assert kvarn.startswith("KV=kvarn needs HyperQwen's vLLM plugin") and "install" in kvarn
    assert off is None and none is None
    assert plugin_refusals(envs, plugin_path, source_only) == [None, None, None]

"""The engine feature registry (engine/features.py): each declaration is what Settings, the
launcher, the engine's reading of its variable, the docs and the doctor use."""

from __future__ import annotations

import ast
import subprocess
import sys
from typing import get_args

import pytest
from cli_runner import ROOT
from loaded_settings import loaded

from hyperqwen import docs
from hyperqwen.doctor import check_engine_features
from hyperqwen.engine.features import (
    FEATURES,
    OFF,
    OUR_LINEAR_BACKEND,
    SPLIT_QKV,
    FeatureSwitchError,
    env_value,
    switched_on,
)
from hyperqwen.launch import BATCH_PROFILE, SINGLE_PROFILES, build_launch
from hyperqwen.settings import Settings, knobs

ENGINE = ROOT / "src" / "hyperqwen" / "engine"


def test_names_knobs_and_variables_are_unique_and_modules_exist():
    for attribute in ("name", "knob", "env", "module"):
        values = [getattr(feature, attribute) for feature in FEATURES]
        assert len(set(values)) == len(values), attribute
    for feature in FEATURES:
        assert (ROOT / "src" / "hyperqwen" / feature.module).is_file(), feature.module
        assert feature.unset in feature.values, feature.name
        assert feature.env.startswith("HYPERQWEN_"), feature.env


def test_each_owned_knob_is_a_settings_field_with_the_features_values():
    infos = {info.name: info for info in knobs()}
    for feature in FEATURES:
        assert feature.knob in Settings.model_fields, feature.knob
        if feature.owned_knob:
            field = Settings.model_fields[feature.knob]
            assert get_args(field.annotation) + feature.more_values == feature.values
            assert field.default == feature.owned_knob.default
            assert infos[feature.knob].becomes == f"env {feature.env} (patched vLLM)"
            assert infos[feature.knob].modes == feature.modes
        for name, declared in feature.more_knobs:
            field = Settings.model_fields[name]
            assert get_args(field.annotation) == declared.values
            assert field.default == declared.default
            assert feature.env in infos[name].becomes
            assert infos[name].modes == declared.modes
        # a value only the launcher sets (from more_knobs) is no value of the switch's knob
        switch = Settings.model_fields[feature.knob].annotation
        assert not set(feature.more_values) & set(get_args(switch))


def test_the_engine_reads_unset_as_the_default_and_refuses_other_values(monkeypatch):
    for feature in FEATURES:
        monkeypatch.delenv(feature.env, raising=False)
        assert env_value(feature) == feature.unset
        for value in feature.values:
            monkeypatch.setenv(feature.env, value)
            assert env_value(feature) == value
            # draft_vocab: auto or off; w4a8_linear: 0 or the layer groups it runs
            assert switched_on(feature) is (value not in (OFF, "off"))
        monkeypatch.setenv(feature.env, "true")
        with pytest.raises(FeatureSwitchError, match=f"{feature.env}='true': expected one of"):
            switched_on(feature)


def test_the_default_launch_runs_each_feature_as_its_knob_default_says():
    """With every knob at its default, what the engine reads (the launcher's variable, or the
    feature's unset value) is the owned knob's default, in every mode whose servers read it."""
    for mode in ("single", "batch"):
        env = build_launch(loaded(), mode, None).env
        for feature in FEATURES:
            if feature.owned_knob and mode in feature.modes:
                assert feature.state(env.get(feature.env)) == feature.owned_knob.default


@pytest.mark.parametrize("mode", ["single", "batch"])
def test_split_qkv_is_on_unless_its_knob_turns_it_off(mode):
    assert SPLIT_QKV.env not in build_launch(loaded(), mode, None).env  # unset means on
    assert build_launch(loaded(GDN_SPLIT_QKV="0"), mode, None).env[SPLIT_QKV.env] == OFF


def test_no_profile_defaults_to_our_linear_backend():
    """w4a16_linear's launch reads LINEAR_BACKEND as set, not the profile's default."""
    profiles = [*SINGLE_PROFILES.values(), BATCH_PROFILE]
    assert all(p.linear_backend != OUR_LINEAR_BACKEND for p in profiles)


REGISTRY = (
    "features.py",
    "features_gdn.py",
    "features_kv.py",
    "features_lookup.py",
    "feature_model.py",
)


@pytest.mark.parametrize("module", REGISTRY)
def test_the_registry_imports_the_standard_library_only(module):
    """It runs inside vLLM's processes: no settings, no pydantic, no torch (features.py's one
    import of the package is feature_model.py, checked the same way)."""
    tree = ast.parse((ENGINE / module).read_text())
    imported = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in (node.names if isinstance(node, ast.Import) else [ast.alias(node.module)])
    }
    stdlib = {name for name in imported if name.split(".")[0] in sys.stdlib_module_names}
    registry = {f"hyperqwen.engine.{name.removesuffix('.py')}" for name in REGISTRY}
    assert imported - stdlib <= {"__future__", *registry}, imported
    probe = (
        "import sys, hyperqwen.engine.features; "
        "print(sorted({'pydantic', 'torch'} & set(sys.modules)))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_engine_modules_read_their_switch_through_the_registry_only():
    """No engine module reads a feature's variable itself (the copies of enabled() it replaced)."""
    for path in ENGINE.glob("*.py"):
        if path.name not in REGISTRY:  # the registry: it reads them
            source = path.read_text()
            assert "os.environ.get(" not in source.replace('os.environ.get("TRITON_INTERPRET")', "")
            assert not any(f'"{feature.env}"' in source for feature in FEATURES), path.name


def test_engine_readme_table_is_generated():
    text = (ROOT / docs.ENGINE_README).read_text()
    start = text.index(docs.FEATURE_TABLE_BEGIN)
    end = text.index(docs.FEATURE_TABLE_END) + len(docs.FEATURE_TABLE_END)
    assert text[start:end] + "\n" == docs.feature_table(), (
        "regenerate: hyperqwen settings --write-docs ."
    )
    for feature in FEATURES:
        assert f"| {feature.name} |" in text


def test_doctor_reports_each_features_state_per_mode_and_stray_variables():
    checks = check_engine_features(loaded(GDN_BA="1", GDN_SPLIT_QKV="0"), {})
    single, batch = (check.detail for check in checks)
    assert single.startswith("single: ") and batch.startswith("batch: ")
    assert "gdn_ba on" in single and "gdn_ba on" in batch
    assert "split_qkv off" in batch and "draft_vocab auto" in single
    assert "lookup" not in batch  # a single-mode feature
    assert all(check.status == "OK" for check in checks)
    stray = check_engine_features(loaded(), {SPLIT_QKV.env: "0"})[-1]
    assert stray.status == "WARN" and SPLIT_QKV.knob in stray.fix

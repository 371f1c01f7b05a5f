"""The seams (src/hyperqwen/engine/seams.py): each declared seam is one function there, called
by the patch the declaration names, and dispatched to the same-named function of each feature
on it; no patch names a feature; with every feature off, each seam leaves vLLM's path and
imports no feature module."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

from hyperqwen.engine import features, seams
from hyperqwen.engine.features import FEATURES, OFF
from hyperqwen.patches.series import load_series

ROOT = Path(__file__).resolve().parents[1]
SEAMS = sorted({seam for feature in FEATURES for seam in feature.seams}, key=lambda s: s.name)


def test_each_seam_is_a_function_called_by_its_patch():
    series = {patch.name: patch for patch in load_series(ROOT / "patches").patches}
    declared = {value for value in vars(features).values() if isinstance(value, features.Seam)}
    assert declared == set(SEAMS), "a declared seam no feature uses, or one not declared"
    for seam in SEAMS:
        assert callable(getattr(seams, seam.name)), seam.name
        assert seam.patch in series, f"{seam.name}: {seam.patch} is not in patches/series"
        added = [line for line in (ROOT / "patches" / seam.patch).read_text().splitlines()
                 if line.startswith("+")]  # fmt: skip
        assert any(f"seams.{seam.name}(" in line for line in added), seam.name


def test_each_feature_module_has_its_seams_functions():
    for feature in FEATURES:
        module = importlib.import_module(f"hyperqwen.engine.{feature.name}")
        for seam in feature.seams:
            assert callable(getattr(module, seam.name, None)), f"{feature.name}.{seam.name}"


def test_no_patch_names_an_engine_feature():
    """A patch names seams: a feature's module, variable or import is in no patch."""
    for path in sorted((ROOT / "patches").glob("*.patch")):
        text = path.read_text()
        for feature in FEATURES:
            for name in (f"engine/{feature.name}.py", f"engine.{feature.name}", feature.env):
                assert name not in text, f"{path.name} names {name}"


ALL_OFF_PROBE = """
import json, sys
from hyperqwen.engine import seams
runner = object()
kernels = ["vLLM's"]
namespace = {}
seams.gdn_module_loaded(namespace)
layer = type("Layer", (), {})()
request = type("Request", (), {"num_tokens": 100, "shared_prefix_boundary": 0})()
seams.gdn_layer_built(layer)
seams.proposer_loaded(runner)
seams.runner_drafter_built(runner)
seams.runner_graphs_dispatched(runner)
seams.runner_counts_on_gpu(runner, 4)
print(json.dumps({
    "namespace": namespace,
    "ba": layer.hyperqwen_ba_projection,
    "qkv": seams.gdn_mixed_qkv(None, 1, 1, 1),
    "kernels": seams.linear_kernels(kernels, True),
    "ngram": seams.ngram_drafts(runner, 1, [0], None, None, 3),
    "buffer": seams.runner_keeps_ngram_buffer(None),
    "step": seams.runner_step_begins(runner, None),
    "copies": seams.runner_copies_scheduler_output(runner),
    "cut": seams.runner_cut_drafts(runner, None),
    "count": seams.runner_draft_count(runner, 3),
    "drafts": seams.runner_drafted(runner, "MTP's", None),
    "kv_spec": seams.attention_kv_spec(object, 16, 4, 256),
    "split": seams.scheduler_mamba_split(request, 0, 100, 96),
    "cache": seams.compile_cache_initialized(),
    "imported": sorted(m for m in sys.modules if m.startswith("hyperqwen.engine.")),
}))
"""


def test_with_every_feature_off_each_seam_is_vllms_path_and_imports_nothing():
    off = {feature.env: "off" if "off" in feature.values else OFF for feature in FEATURES}
    env = {**os.environ, **off, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, "-c", ALL_OFF_PROBE], env=env, capture_output=True,
                          text=True, check=True, timeout=120)  # fmt: skip
    assert json.loads(done.stdout) == {
        "namespace": {},
        "ba": None,
        "qkv": None,
        "kernels": ["vLLM's"],
        "ngram": None,
        "buffer": False,
        "step": False,
        "copies": False,
        "cut": {},
        "count": 3,
        "drafts": "MTP's",
        "kv_spec": None,
        "split": 96,
        "cache": None,
        "imported": [
            "hyperqwen.engine.feature_model",
            "hyperqwen.engine.features",
            "hyperqwen.engine.features_gdn",
            "hyperqwen.engine.features_kv",
            "hyperqwen.engine.features_lookup",
            "hyperqwen.engine.seams",
        ],
    }

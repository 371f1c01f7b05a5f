"""Knobs of how vLLM runs a step: MODEL_RUNNER (vLLM's model runner; the engine features only the
V1 runner calls, their seams in patches/v1-runner.patch and the V1 n-gram proposer, kept off or
refused under v2) and INDUCTOR_PDL (torch Inductor's kernels with dependent launch)."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_runner import hyperqwen, path_with_nvidia_smi
from loaded_settings import loaded

from hyperqwen.engine.features import (
    ALIGN_OVERLAP,
    DRAFT_VOCAB,
    FEATURES,
    GDN_REPLAY,
    KVARN,
    LOOKUP,
    SPLIT_QKV,
)
from hyperqwen.gpu import parse_smi_line
from hyperqwen.launch import (
    INDUCTOR_PDL_KEY,
    RUNNER_ENV,
    RunnerRefusal,
    build_launch,
    inductor_pdl_refusal,
)
from hyperqwen.settings import SettingsError, load_settings


@pytest.mark.parametrize("mode", ["single", "batch"])
@pytest.mark.parametrize(("runner", "variable"), [("auto", None), ("v1", "0"), ("v2", "1")])
def test_the_runner_reaches_vllm_through_its_variable(monkeypatch, mode, runner, variable):
    import vllm.envs

    env = build_launch(loaded(MODEL_RUNNER=runner), mode, None).env
    assert env.get(RUNNER_ENV) == variable
    if variable is None:
        monkeypatch.delenv(RUNNER_ENV, raising=False)
    else:
        monkeypatch.setenv(RUNNER_ENV, variable)
    # what vLLM 0.26 reads from it: None lets vLLM choose (V1 for a hybrid model)
    assert (
        vllm.envs.environment_variables[RUNNER_ENV]()
        == {None: None, "0": False, "1": True}[variable]
    )


def test_a_runner_vllm_does_not_have_is_refused_by_name(tmp_path: Path):
    with pytest.raises(SettingsError, match=r"MODEL_RUNNER='v3'.*auto \| v1 \| v2"):
        load_settings(environ={"MODEL_RUNNER": "v3"}, env_file=tmp_path / "none.env")


def test_the_features_only_the_v1_runner_calls_are_those_with_a_v1_runner_seam():
    needs = {feature.name for feature in FEATURES if feature.needs_v1_runner}
    assert {LOOKUP.name, ALIGN_OVERLAP.name, GDN_REPLAY.name} <= needs
    assert not {DRAFT_VOCAB.name, SPLIT_QKV.name, KVARN.name} & needs
    for feature in FEATURES:
        in_v1_patch = any(seam.patch == "v1-runner.patch" for seam in feature.seams)
        assert feature.needs_v1_runner >= in_v1_patch, feature.name


def test_v2_keeps_the_v1_runner_features_off_and_says_which():
    on_v1 = build_launch(loaded(), "single", None)
    assert on_v1.env[LOOKUP.env] == "auto" and on_v1.env[ALIGN_OVERLAP.env] == "1"
    assert not any("MODEL_RUNNER" in notice for notice in on_v1.notices)
    plan = build_launch(loaded(MODEL_RUNNER="v2"), "single", None)
    assert LOOKUP.env not in plan.env and ALIGN_OVERLAP.env not in plan.env
    assert plan.env[DRAFT_VOCAB.env] == "auto"  # the V2 runner's speculator loads it too
    (notice,) = [notice for notice in plan.notices if "MODEL_RUNNER=v2" in notice]
    assert LOOKUP.name in notice and ALIGN_OVERLAP.name in notice
    # batch mode runs neither: nothing to say
    batch = build_launch(loaded(MODEL_RUNNER="v2"), "batch", None)
    assert not any("MODEL_RUNNER" in notice for notice in batch.notices)


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"SPEC": "ngram"}, "SPEC=ngram"),
        ({"SPEC": "lookup"}, "SPEC=lookup"),
        ({"LOOKUP": "1"}, "LOOKUP=1"),
        ({"PREFIX_CACHE_OVERLAP": "1"}, "PREFIX_CACHE_OVERLAP=1"),
        ({"GDN_REPLAY": "1"}, "GDN_REPLAY=1"),
    ],
)
def test_v2_refuses_a_knob_set_to_what_only_the_v1_runner_runs(values, named):
    with pytest.raises(RunnerRefusal, match=f"{named} needs vLLM's V1 model runner.*MODEL_RUNNER"):
        build_launch(loaded(MODEL_RUNNER="v2", **values), "single", None)
    build_launch(loaded(MODEL_RUNNER="v1", **values), "single", None)  # the same on V1 serves


def test_v2_takes_an_auto_or_off_knob_of_such_a_feature():
    for values in ({"LOOKUP": "auto"}, {"LOOKUP": "0"}, {"PREFIX_CACHE_OVERLAP": "0"}):
        plan = build_launch(loaded(MODEL_RUNNER="v2", **values), "single", None)
        assert LOOKUP.env not in plan.env


def test_inductor_pdl_reaches_vllm_s_compilation_config_and_its_cache_key(vllm_serve):
    import torch._inductor.config as inductor
    from vllm.config import CompilationConfig

    configs = {}
    for value in ("0", "1"):
        args = vllm_serve(build_launch(loaded(INDUCTOR_PDL=value), "single", None).argv)
        configs[value] = args.compilation_config
        assert isinstance(configs[value], CompilationConfig)
    assert configs["1"].inductor_compile_config[INDUCTOR_PDL_KEY] is True
    assert INDUCTOR_PDL_KEY not in configs["0"].inductor_compile_config
    # a graph compiled without it is not loaded with it: vLLM's config hash differs
    assert configs["0"].compute_hash() != configs["1"].compute_hash()
    # the key is Inductor's own (a misspelt one would be refused here)
    assert inductor.triton.enable_pdl is False
    with inductor.patch({INDUCTOR_PDL_KEY: True}):
        assert inductor.triton.enable_pdl is True


def test_inductor_pdl_is_refused_by_name_on_a_card_that_would_leave_it_out(tmp_path):
    rtx_3090 = parse_smi_line("0, NVIDIA GeForce RTX 3090, 8.6, 24576, 560.35, 350.00")
    h200 = parse_smi_line("0, NVIDIA H200, 9.0, 143771, 580.95, 700.00")
    on = loaded(INDUCTOR_PDL="1").settings
    message = inductor_pdl_refusal(on, [h200, rtx_3090])
    assert "INDUCTOR_PDL=1 needs compute capability 9.0" in message
    assert "NVIDIA GeForce RTX 3090 (sm86)" in message and "Set INDUCTOR_PDL=0." in message
    assert inductor_pdl_refusal(on, [h200]) is None
    assert inductor_pdl_refusal(loaded().settings, [rtx_3090]) is None
    # through `hyperqwen serve`, before vLLM, on a stand-in 3090
    path = path_with_nvidia_smi(tmp_path, "0, NVIDIA GeForce RTX 3090, 8.6, 24576, 560.35, 350.00")
    env = {"INDUCTOR_PDL": "1", "PRINT_ARGV": "1", "PATH": path}
    done = hyperqwen("serve", "single", env=env, cwd=tmp_path)
    assert done.returncode == 2
    assert "refusing to start: INDUCTOR_PDL=1 needs compute capability 9.0" in done.stderr
    env["INDUCTOR_PDL"] = "0"
    assert hyperqwen("serve", "single", env=env, cwd=tmp_path).returncode == 0

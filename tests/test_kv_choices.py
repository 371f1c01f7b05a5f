"""KV=: every vLLM 0.26 KV-cache dtype that serves Qwen3.5 reaches vLLM's own parser with the
attention backend it needs, in both modes; the combinations that cannot serve are refused
before vLLM starts, naming KV, the other knob and the fix; and the vLLM facts the choices rest
on (kv_choices.py) still hold in the pinned vLLM, so a pin bump that changes one fails here."""

from __future__ import annotations

import inspect
import json
from typing import get_args

import pytest
from cli_runner import ROOT, hyperqwen, path_with_nvidia_smi
from loaded_settings import loaded

from hyperqwen import docs
from hyperqwen.capacity import TURBOQUANT_BITS
from hyperqwen.engine.features import KVARN as KVARN_FEATURE
from hyperqwen.gpu import parse_smi_line
from hyperqwen.kv_choices import (
    CUSTOM,
    KV_CACHE_DTYPES,
    KV_CHOICES,
    KVARN_CHOICE,
    KVARN_MAX_DRAFTS,
    TRITON,
    TURBOQUANT,
    capability_refusal,
    head_layout_refusal,
    speculation_refusal,
)
from hyperqwen.launch import KvRefusal, build_launch
from hyperqwen.settings import Settings

TURBOQUANTS = [kv for kv in KV_CACHE_DTYPES if kv.startswith("turboquant_")]
SPECULATING = ("mtp", "ngram", "lookup")
RTX_3090 = parse_smi_line("0, NVIDIA GeForce RTX 3090, 8.6, 24576, 560.35, 350.00")
RTX_4090 = parse_smi_line("1, NVIDIA GeForce RTX 4090, 8.9, 24564, 560.35, 450.00")
H200 = parse_smi_line("0, NVIDIA H200, 9.0, 143771, 580.95, 700.00")


def serving(kv: str) -> list[tuple[str, dict[str, str]]]:
    """(mode, knobs) a KV choice serves with: single with MTP and prefix caching (SPEC=off for
    TurboQuant, which cannot speculate) at each CTX, and batch."""
    spec = "mtp" if KV_CHOICES[kv].speculation else "off"
    single = [("single", dict(KV=kv, CTX=ctx, SPEC=spec)) for ctx in ("fast", "long", "huge")]
    return [*single, ("batch", dict(KV=kv))]


CASES = [(kv, mode, values) for kv in KV_CACHE_DTYPES for mode, values in serving(kv)]


@pytest.mark.parametrize(("kv", "mode", "values"), CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_each_choice_reaches_vllm_with_the_backend_it_needs(vllm_serve, kv, mode, values):
    plan = build_launch(loaded(**values), mode, api_key=None)
    args = vllm_serve(plan.argv)
    assert args.kv_cache_dtype == kv
    assert args.enable_prefix_caching is True
    backend = KV_CHOICES[kv].attention_backend
    if backend is None:  # vLLM's selector picks it, as for the shipped profiles
        assert "--attention-backend" not in plan.argv
    else:
        assert args.attention_backend == backend
    if backend == TURBOQUANT:
        assert args.attention_config.flash_attn_version == 2
    if mode == "single" and values["SPEC"] == "mtp":
        assert args.speculative_config["method"] == "mtp"
    assert plan.warnings == []


def test_unset_kv_keeps_each_profiles_dtype_and_adds_no_backend():
    for mode, values, dtype in [
        ("single", {"CTX": "fast"}, "auto"),
        ("single", {"CTX": "long"}, "fp8"),
        ("single", {"CTX": "huge"}, "fp8"),
        ("batch", {}, "fp8"),
    ]:
        argv = build_launch(loaded(**values), mode, api_key=None).argv
        assert argv[argv.index("--kv-cache-dtype") + 1] == dtype
        assert "--attention-backend" not in argv and "--attention-config" not in argv


@pytest.mark.parametrize("spec", SPECULATING)
@pytest.mark.parametrize("kv", TURBOQUANTS)
def test_turboquant_with_speculation_is_refused_naming_both_knobs_and_the_fix(kv, spec):
    with pytest.raises(KvRefusal) as refusal:
        build_launch(loaded(KV=kv, SPEC=spec), "single", api_key=None)
    message = str(refusal.value)
    assert message.startswith(f"KV={kv} cannot serve with SPEC={spec}: ")
    instead = "KV=kvarn, the smallest" if spec == "mtp" else f"KV=fp8 with SPEC={spec}"
    assert f"Use SPEC=off with TurboQuant, or {instead}" in message
    # batch mode never speculates: SPEC there is only an ignored single-mode knob
    plan = build_launch(loaded(KV=kv, SPEC=spec), "batch", api_key=None)
    assert plan.warnings == ["SPEC is a single-mode knob; ignored in batch mode."]


def test_only_turboquant_is_refused_with_speculation():
    refused = {kv for kv in KV_CACHE_DTYPES if speculation_refusal(kv, "mtp")}
    assert all(speculation_refusal(kv, spec) for kv in refused for spec in SPECULATING)
    assert refused == set(TURBOQUANTS) == set(TURBOQUANT_BITS)
    assert not any(speculation_refusal(kv, "off") for kv in KV_CACHE_DTYPES)


def test_the_refusal_comes_before_vllm_through_the_cli(tmp_path):
    done = hyperqwen(
        "serve", "single", env={"KV": "turboquant_4bit_nc", "PRINT_ARGV": "1"}, cwd=tmp_path
    )
    assert done.returncode == 2
    assert "refusing to start: KV=turboquant_4bit_nc cannot serve with SPEC=mtp" in done.stderr
    assert done.stdout == ""  # no vLLM command printed


def test_fp8_per_token_head_needs_ada_or_hopper():
    message = capability_refusal("fp8_per_token_head", [RTX_4090, RTX_3090])
    assert message.startswith("KV=fp8_per_token_head needs compute capability 8.9 or newer")
    assert "NVIDIA GeForce RTX 3090 (sm86)" in message and "4090" not in message
    assert "Use KV=int8_per_token_head (the same size) or KV=fp8." in message
    assert capability_refusal("fp8_per_token_head", [RTX_4090, H200]) is None
    for kv in set(KV_CACHE_DTYPES) - {"fp8_per_token_head"}:
        assert capability_refusal(kv, [RTX_3090]) is None, kv


def test_the_gpu_check_refuses_before_vllm_through_the_cli(tmp_path):
    path = path_with_nvidia_smi(tmp_path, "0, NVIDIA GeForce RTX 3090, 8.6, 24576, 560.35, 350.00")
    env = {"KV": "fp8_per_token_head", "PRINT_ARGV": "1", "PATH": path}
    done = hyperqwen("serve", "batch", env=env, cwd=tmp_path)
    assert done.returncode == 2
    assert "refusing to start: KV=fp8_per_token_head needs compute capability 8.9" in done.stderr
    env["KV"] = "int8_per_token_head"
    assert hyperqwen("serve", "batch", env=env, cwd=tmp_path).returncode == 0


@pytest.mark.parametrize("kv", ["nvfp4", "float16", "fp8_inc", "fp8_ds_mla", "int8"])
def test_other_names_are_refused_by_name(kv):
    with pytest.raises(ValueError, match="KV"):
        Settings.model_validate({"KV": kv})


@pytest.mark.parametrize("relative", docs.KV_TABLE_FILES)
def test_the_kv_tables_in_the_docs_are_generated(relative):
    text = (ROOT / relative).read_text()
    start = text.index(docs.KV_TABLE_BEGIN)
    end = text.index(docs.KV_TABLE_END) + len(docs.KV_TABLE_END)
    table = docs.kv_table()
    assert text[start:end] + "\n" == table, "regenerate: hyperqwen settings --write-docs ."
    assert "`--attention-backend TRITON_ATTN`" in table and "no verify path" in table


# --- the vLLM 0.26 facts kv_choices.py rests on -------------------------------------------


def test_the_choices_are_vllms_own_dtypes(vllm_cpu_platform):
    from vllm.config.cache import CacheDType

    assert set(KV_CACHE_DTYPES) <= set(get_args(CacheDType))
    left_out = set(get_args(CacheDType)) - set(KV_CACHE_DTYPES)
    assert left_out == {"float16", "bfloat16", "fp8_inc", "fp8_ds_mla", "nvfp4"}


def test_the_named_backends_alone_take_their_dtypes(vllm_cpu_platform):
    """Each dtype the launcher names a backend for is one that backend takes and that none of
    the others vLLM's selector tries on sm80-sm90 does (platforms/cuda.py:
    _get_backend_priorities)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    others = ["FLASH_ATTN", "FLASHINFER", "FLEX_ATTENTION"]
    for name in (TRITON, TURBOQUANT):
        backend = AttentionBackendEnum[name].get_class()
        named = [kv for kv, choice in KV_CHOICES.items() if choice.attention_backend == name]
        assert named and all(backend.supports_kv_cache_dtype(kv) for kv in named), name
        for other in others + [n for n in (TRITON, TURBOQUANT) if n != name]:
            taken = AttentionBackendEnum[other].get_class().supported_kv_cache_dtypes
            assert not set(named) & set(taken), (name, other)


def test_turboquant_still_has_no_speculative_verify_path(vllm_cpu_platform):
    """The refusal's reason; when a vLLM pin gives TurboQuant a spec-as-decode path, this fails
    and the refusal can go."""
    from vllm.v1.attention.backends.turboquant_attn import TurboQuantMetadataBuilder

    source = inspect.getsource(TurboQuantMetadataBuilder.__init__)
    assert "_init_reorder_batch_threshold(1, supports_spec_as_decode=False)" in source
    prefill = inspect.getsource(TurboQuantMetadataBuilder.build)
    assert "seq_lens_cpu=cam.seq_lens_cpu_upper_bound" in prefill


def test_kvarn_reaches_vllm_as_its_custom_backend_on_auto_pages(vllm_serve):
    """KV=kvarn: vLLM's cache dtype stays auto, `--attention-backend CUSTOM` selects the backend
    the plugin registers because the launcher sets its variable (test_vllm_plugin.py)."""
    for mode, values in [("single", dict(SPEC="off")), ("single", dict(SPEC="mtp")), ("batch", {})]:
        plan = build_launch(loaded(KV=KVARN_CHOICE, **values), mode, api_key=None)
        args = vllm_serve(plan.argv)
        assert (args.kv_cache_dtype, args.attention_backend) == ("auto", CUSTOM)
        assert plan.env[KVARN_FEATURE.env] == "1"
        if values.get("SPEC") == "mtp":
            assert args.speculative_config["num_speculative_tokens"] == KVARN_MAX_DRAFTS
            # the MTP layer on KVarN too: vLLM picks the drafter's backend apart from
            # --attention-backend (test_kvarn_mtp_pages.py: its pages through vLLM)
            assert args.speculative_config["attention_backend"] == CUSTOM
    plan = build_launch(loaded(KV="fp8"), "single", api_key=None)
    assert KVARN_FEATURE.env not in plan.env
    # vLLM's own dtypes leave the drafter's backend to vLLM's selector
    for kv, choice in KV_CHOICES.items():
        if kv != KVARN_CHOICE and "mtp" in choice.speculation:
            args = vllm_serve(build_launch(loaded(KV=kv, SPEC="mtp"), "single", None).argv)
            assert "attention_backend" not in args.speculative_config


@pytest.mark.parametrize("spec", ["ngram", "lookup"])
def test_kvarn_with_an_ngram_drafter_is_refused_naming_both_knobs(spec):
    with pytest.raises(KvRefusal) as refusal:
        build_launch(loaded(KV=KVARN_CHOICE, SPEC=spec), "single", api_key=None)
    message = str(refusal.value)
    assert message.startswith(f"KV=kvarn cannot serve with SPEC={spec}: ")
    assert message.endswith("Use SPEC=mtp or SPEC=off with KV=kvarn.")
    assert speculation_refusal(KVARN_CHOICE, spec, 2) is not None  # by name, not width


def test_kvarn_speculates_with_mtp_up_to_the_verify_width_its_kernel_is_fitted_to():
    from hyperqwen.kvarn.fit import VERIFY_QUERIES

    assert VERIFY_QUERIES == 1 + KVARN_MAX_DRAFTS
    for drafts in (None, 1, KVARN_MAX_DRAFTS):
        assert speculation_refusal(KVARN_CHOICE, "mtp", drafts) is None
    wide = KVARN_MAX_DRAFTS + 1
    with pytest.raises(KvRefusal) as refusal:
        build_launch(loaded(KV=KVARN_CHOICE, DRAFT_TOKENS=str(wide)), "single", api_key=None)
    message = str(refusal.value)
    assert message.startswith(f"KV=kvarn cannot serve with DRAFT_TOKENS={wide}: ")
    assert message.endswith(f"Use DRAFT_TOKENS={KVARN_MAX_DRAFTS} or fewer with KV=kvarn.")
    # batch mode never speculates
    assert build_launch(loaded(KV=KVARN_CHOICE, DRAFT_TOKENS=str(wide)), "batch", api_key=None)


# --- int4_per_token_head and the head layouts hadacore rotates ---------------------------------

SMOLLM2_HEADS = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3}
QWEN_27B_HEADS = {
    "text_config": {"num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256}
}


@pytest.mark.parametrize(
    ("config", "tensor_parallel", "refused"),
    [
        (SMOLLM2_HEADS, 1, "9 query heads of 64 and 3 KV heads of 64"),
        (QWEN_27B_HEADS, 1, None),  # 24 x 256 and 4 x 256: even chunk counts at any length
        (QWEN_27B_HEADS, 2, None),
        (QWEN_27B_HEADS, 4, "1 KV heads of 256"),  # one KV head per GPU: odd token counts hit
        (QWEN_27B_HEADS, 8, "3 query heads of 256 and 1 KV heads of 256"),
    ],
)
def test_int4_per_token_head_is_refused_where_hadacore_sees_odd_chunk_counts(
    config, tensor_parallel, refused
):
    reason = head_layout_refusal("int4_per_token_head", config, tensor_parallel)
    if refused is None:
        assert reason is None
    else:
        assert f"KV=int4_per_token_head with this model's {refused} per GPU" in reason
        assert "vllm-project/vllm#53167" in reason and "KV=int8_per_token_head" in reason
    for other in (kv for kv in KV_CHOICES if kv != "int4_per_token_head"):
        assert head_layout_refusal(other, config, tensor_parallel) is None


def test_int4_per_token_head_still_rotates_through_hadacore_in_the_pinned_vllm():
    """The refusal rests on this: a pin whose int4 cache stops calling hadacore retires it."""
    from vllm.v1.attention.ops import int4_per_token_head

    assert "ops.hadacore_transform(" in inspect.getsource(int4_per_token_head)


def test_serve_refuses_int4_per_token_head_for_such_a_model_before_the_gpu_check(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(SMOLLM2_HEADS))
    env = {"MODEL": str(model), "KV": "int4_per_token_head"}
    done = hyperqwen("serve", "batch", env=env, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "refusing to start: KV=int4_per_token_head with this model's 9 query heads" in (
        done.stderr
    )
    # int8_per_token_head on the same folder gets as far as the missing GPU
    env["KV"] = "int8_per_token_head"
    assert hyperqwen("serve", "batch", env=env, cwd=tmp_path).returncode == 3

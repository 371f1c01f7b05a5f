"""Summing vLLM's torch-profiler trace into GPU time per decode step (bench/profile.py)."""

from __future__ import annotations

import gzip
import json

import pytest

from hyperqwen.bench import profile


@pytest.mark.parametrize(
    ("kernel", "expected"),
    [
        ("void machete::MacheteKernelTemplate<cutlass::bfloat16_t, ...>", "w4a16_gemm"),
        ("void marlin::Marlin<__nv_bfloat16, 4, 256, 8, 8, true>(...)", "w4a16_gemm"),
        ("_w4a16_kernel", "w4a16_gemm"),
        ("fused_recurrent_gated_delta_rule_fwd_kernel", "gdn"),
        ("_causal_conv1d_update_kernel", "gdn"),
        ("void flash::flash_fwd_splitkv_kernel<...>", "attention"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64", "dense_gemm"),
        ("void gemv2T_kernel_val<int, int, __nv_bfloat16, ...>", "dense_gemm"),
        ("_draft_argmax_kernel", "dense_gemm"),  # not sampling: it is the draft head's GEMV
        ("void vllm::rms_norm_kernel<c10::BFloat16>(...)", "norm_activation"),
        ("void vllm::act_and_mul_kernel<...silu...>", "norm_activation"),
        ("_topk_topp_kernel", "sampling"),
        ("Memset (Device)", "memory"),
        ("triton_poi_fused_add_0", "other"),
        ("fused_sigmoid_gating_delta_rule_update_kernel", "gdn"),
        # torch.compile's fused kernels, named after the Marlin GEMM they feed, are not GEMMs
        ("triton_red_fused__to_copy_add_fused_add_rms_norm_marlin_gemm_3", "norm_activation"),
        ("triton_poi_fused_marlin_gemm_mul_sigmoid_view_0", "norm_activation"),
        ("triton_per_fused_marlin_gemm_0", "other"),
    ],
)
def test_kernels_fall_into_their_category(kernel, expected):
    assert profile.category(kernel) == expected


def write_trace(path, events):
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        json.dump({"traceEvents": events}, handle)
    return path


def test_summary_is_gpu_time_per_engine_step(tmp_path):
    # as vLLM 0.26's worker names a decode step; its GPU copy and the runner's own ranges
    # (only with VLLM_CUSTOM_SCOPES_FOR_PROFILING) are not steps
    name = "execute_context_0(0)_generation_1(4)"
    step = {"ph": "X", "cat": "user_annotation", "name": name, "dur": 9000}
    events = [step, step, {**step, "cat": "gpu_user_annotation"}]
    events += [{**step, "name": "gpu_model_runner: forward"}]
    events += [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "dur": 5000}]
    events += [{"ph": "X", "cat": "kernel", "name": "void marlin::Marlin<>", "dur": 3000}] * 4
    events += [{"ph": "X", "cat": "gpu_memset", "name": "Memset (Device)", "dur": 100}] * 2
    events += [{"ph": "i", "cat": "kernel", "name": "instant, not a duration", "dur": 1e9}]
    summary = profile.summarize(profile.load_trace(write_trace(tmp_path / "t.json.gz", events)))
    assert summary["steps"] == 2
    assert summary["categories"] == {"w4a16_gemm": 6.0, "memory": 0.1}  # ms per step
    assert summary["gpu_ms_per_step"] == 6.1
    assert summary["top_kernels"][0] == {
        "name": "void marlin::Marlin<>",
        "ms_per_step": 6.0,
        "launches_per_step": 2.0,
    }
    assert profile.profile_rows(summary)["step_gpu_ms_w4a16_gemm"] == ("ms", 6.0)


def test_a_trace_without_engine_steps_says_why(tmp_path):
    kernel = {"ph": "X", "cat": "kernel", "name": "k", "dur": 1}
    trace = profile.load_trace(write_trace(tmp_path / "t.json.gz", [kernel]))
    with pytest.raises(profile.ProfileError, match="no engine step was profiled"):
        profile.summarize(trace)
    (tmp_path / "bad.json").write_text("[]")
    with pytest.raises(profile.ProfileError, match="no traceEvents list"):
        profile.load_trace(tmp_path / "bad.json")


def test_profiler_flags_are_a_config_vllm_accepts(tmp_path):
    from vllm.config import ProfilerConfig

    flag, value = profile.profiler_flags(tmp_path / "trace", steps=20, delay_steps=3)
    config = ProfilerConfig(**json.loads(value))
    assert flag == "--profiler-config" and config.profiler == "torch"
    assert (config.max_iterations, config.delay_iterations) == (20, 3)
    assert config.torch_profiler_dir == str((tmp_path / "trace").resolve())
    assert not config.torch_profiler_with_stack and config.ignore_frontend
    assert not config.torch_profiler_dump_cuda_time_total  # its table took minutes to average

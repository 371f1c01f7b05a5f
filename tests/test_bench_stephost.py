"""Where the profiled host thread's time goes per decode step (bench/stephost.py), on a synthetic
trace whose every time is written out below, so each expected figure is worked by hand."""

from __future__ import annotations

import pytest

from hyperqwen.bench.profile import ProfileError
from hyperqwen.bench.stephost import blocks_host, host_lines, host_rows, host_summary

HOST, OTHER_THREAD, STREAM = 100, 200, 7
DECODE = "execute_context_0(0)_generation_1(4)"
PREFILL = "execute_context_1(128)_generation_0(0)"
WINDOW_US = 200


def event(name, cat, start, end, tid=HOST):
    return {
        "ph": "X",
        "cat": cat,
        "name": name,
        "pid": 1,
        "tid": tid,
        "ts": start,
        "dur": end - start,
    }


def decode_window(t: float) -> list[dict]:
    """One decode step's host work from t: the step range (60 us: an ATen copy, an async copy
    and a graph launch in it), a 40 us stream synchronization, the sampler's range (30 us, one
    kernel launch in it), a 15 us ATen op; the other 55 us are in no recorded event."""
    return [
        event(DECODE, "user_annotation", t, t + 60),
        event("aten::copy_", "cpu_op", t + 5, t + 15),
        event("cudaMemcpyAsync", "cuda_runtime", t + 7, t + 9),
        event("cudaGraphLaunch", "cuda_runtime", t + 20, t + 30),
        event("cudaStreamSynchronize", "cuda_runtime", t + 70, t + 110),
        event("sample_tokens", "user_annotation", t + 120, t + 150),
        event("cudaLaunchKernel", "cuda_runtime", t + 125, t + 127),
        event("aten::empty", "cpu_op", t + 180, t + 195),
        # another thread's work and the GPU's own events are not the host thread's
        event("aten::mm", "cpu_op", t, t + 200, tid=OTHER_THREAD),
        event("void marlin::Marlin<...>", "kernel", t + 30, t + 180, tid=STREAM),
    ]


def trace(decode_steps: int = 3) -> list[dict]:
    """A prefill range at 0, `decode_steps` decode windows from 1000, one more range (its
    window has no end, so it is not counted), a stray step range on another thread and a
    range around them all."""
    events = [event(PREFILL, "user_annotation", 0, 900), event("aten::mm", "cpu_op", 10, 800)]
    for index in range(decode_steps):
        events += decode_window(1000 + index * WINDOW_US)
    end = 1000 + decode_steps * WINDOW_US
    events.append(event(DECODE, "user_annotation", end, end + 60))
    events.append(event(DECODE, "user_annotation", 1000, 1020, tid=OTHER_THREAD))
    # a range around the engine's loop encloses every window: it tells nothing of a step
    events.append(event("engine_core_busy_loop", "user_annotation", 950, end + 500))
    events.append({"ph": "i", "cat": "cpu_op", "name": "instant", "ts": 1001, "tid": HOST})
    return events


def test_blocking_calls_are_the_synchronizations_and_synchronous_copies() -> None:
    def runtime(name, cat="cuda_runtime"):
        return {"cat": cat, "name": name}

    assert blocks_host(runtime("cudaStreamSynchronize"))
    assert blocks_host(runtime("cudaEventSynchronize"))
    assert blocks_host(runtime("cudaDeviceSynchronize"))
    assert blocks_host(runtime("cudaMemcpy"))
    assert blocks_host(runtime("cuMemcpyDtoH_v2", "cuda_driver"))
    assert not blocks_host(runtime("cudaMemcpyAsync"))
    assert not blocks_host(runtime("cuMemcpyDtoHAsync_v2", "cuda_driver"))
    assert not blocks_host(runtime("cudaLaunchKernel"))
    assert not blocks_host(runtime("cudaGraphLaunch"))
    assert not blocks_host(runtime("cudaStreamSynchronize", "cpu_op"))  # not a CUDA call


def test_each_decode_window_splits_into_waiting_launching_recorded_and_unrecorded() -> None:
    host = host_summary(trace())
    assert host["windows"] == 3
    assert host["host_window_ms"] == 0.2
    assert host["host_waiting_on_gpu_ms"] == 0.04
    assert host["host_launching_ms"] == 0.014  # 2 + 10 + 2 us
    assert host["host_other_recorded_ms"] == round((60 + 40 + 30 + 15 - 40 - 14) / 1000, 4)
    assert host["host_unrecorded_ms"] == 0.055
    outermost = {row["name"]: row for row in host["host_outermost"]}
    assert list(outermost)[:3] == [DECODE, "cudaStreamSynchronize", "sample_tokens"]
    assert outermost[DECODE] == {"name": DECODE, "count_per_step": 1.0, "ms_per_step": 0.06}
    assert outermost["aten::empty"] == {
        "name": "aten::empty",
        "count_per_step": 1.0,
        "ms_per_step": 0.015,
    }
    assert "aten::copy_" not in outermost  # inside the step range
    assert "aten::mm" not in outermost  # the other thread's, and the prefill's
    assert "engine_core_busy_loop" not in outermost


def test_rows_and_lines_carry_every_figure() -> None:
    host = host_summary(trace())
    rows = host_rows(host)
    assert rows["profiled_host_waiting_on_gpu_ms"] == ("ms", 0.04)
    assert set(rows) == {
        "profiled_host_window_ms",
        "profiled_host_waiting_on_gpu_ms",
        "profiled_host_launching_ms",
        "profiled_host_other_recorded_ms",
        "profiled_host_unrecorded_ms",
    }
    text = "\n".join(host_lines(host))
    assert "3 windows" in text and "waiting on the GPU 0.04 ms" in text
    assert f"0.0600 ms, 1x  {DECODE}" in text


def test_a_trace_without_a_host_decode_window_is_refused_by_what_it_lacks() -> None:
    gpu_only = [event(DECODE, "gpu_user_annotation", 1000, 1060, tid=STREAM)]
    with pytest.raises(ProfileError, match="no CPU execute_context_"):
        host_summary(gpu_only)
    one_range = trace(decode_steps=0)  # the prefill range and one decode range with none after
    with pytest.raises(ProfileError, match="profile more steps"):
        host_summary(one_range)

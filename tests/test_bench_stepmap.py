"""The step map (bench/stepmap.py, bench/stepmap_cli.py) on a synthetic profiler trace whose
every time is written out below, so each expected figure is worked by hand."""

from __future__ import annotations

import gzip
import json
import shlex
from pathlib import Path

import pytest
from cli_runner import run_in_process
from local_server import serving
from openai_test_server import build_app, parse_args

from hyperqwen.bench import stepmap, stepmap_cli
from hyperqwen.bench.kernels import moved_bytes
from hyperqwen.bench.profile import PROFILE_DELAY_STEPS, ProfileError, load_trace
from hyperqwen.bench.results import validate_result
from hyperqwen.bench.stepmap_cli import server_flags
from hyperqwen.checkpoint.geometry import PRESETS
from hyperqwen.checkpoint.synthesize import synthesize
from hyperqwen.synth import prepared_quantization_edit

# One GDN layer, then one attention layer: 8 body GEMMs and the int8 lm_head per forward.
GEOMETRY = PRESETS["tiny"].with_overrides(["num_hidden_layers=2", "full_attention_interval=2"])
FACTS = stepmap.ModelFacts(GEOMETRY, lm_head_bits=8)
MARLIN = "void marlin::Marlin<__nv_bfloat16, 4, 256, 8, 8, true>(...)"
DECODE = "execute_context_0(0)_generation_1(4)"
COMPUTE, SIDE = 7, 9  # the streams (trace tids)
STEP_US = 175
# One decode step as (name, trace category, start, end, stream), microseconds from its start.
# The forward (the step's range) is ops 0-14 and ends at 95; then the sampled tokens' copy, the
# rejection sampler, the MTP drafter (a GEMM and attention) and its argmax.
STEP_OPS = [
    (MARLIN, "kernel", 0, 10, COMPUTE),  # gdn_in_proj_qkvz
    ("nvjet_tst_64x8_64x16_4x1_v_bz_TNT", "kernel", 11, 13, COMPUTE),  # bf16 in_proj_ba
    ("fused_recurrent_gated_delta_rule_fwd_kernel", "kernel", 14, 17, COMPUTE),
    (MARLIN, "kernel", 18, 23, COMPUTE),  # gdn_out_proj
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "kernel", 24, 25, COMPUTE),
    (MARLIN, "kernel", 26, 36, COMPUTE),  # mlp_gate_up
    ("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy", 30, 34, SIDE),  # inside the GEMM's time
    ("void vllm::act_and_mul_kernel<c10::BFloat16>", "kernel", 37, 38, COMPUTE),
    (MARLIN, "kernel", 39, 40, COMPUTE),  # mlp_down
    (MARLIN, "kernel", 41, 49, COMPUTE),  # attn_qkv
    ("void flash::flash_fwd_splitkv_kernel<...>", "kernel", 50, 54, COMPUTE),
    ("mystery_kernel_nobody_named", "kernel", 55, 57, COMPUTE),
    (MARLIN, "kernel", 58, 61, COMPUTE),  # attn_o
    (MARLIN, "kernel", 62, 72, COMPUTE),  # mlp_gate_up
    (MARLIN, "kernel", 73, 74, COMPUTE),  # mlp_down
    (MARLIN, "kernel", 75, 95, COMPUTE),  # lm_head
    ("Memcpy DtoH (Device -> Pinned)", "gpu_memcpy", 95, 97, COMPUTE),
    ("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy", 98, 99, SIDE),
    ("rejection_greedy_sample_kernel", "kernel", 100, 102, COMPUTE),
    (MARLIN, "kernel", 142, 150, COMPUTE),  # the drafter's, after a 40 us wait on the host
    ("void flash::flash_fwd_splitkv_kernel<...>", "kernel", 151, 153, COMPUTE),
    ("argmax_kernel", "kernel", 154, 155, COMPUTE),
]
FORWARD_US = 95


def op_event(name, cat, start, end, tid):
    return {
        "ph": "X",
        "cat": cat,
        "name": name,
        "pid": 0,
        "tid": tid,
        "ts": start,
        "dur": end - start,
    }


def step_range(name, start, dur, tid=COMPUTE, cat=stepmap.GPU_RANGE):
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": tid, "ts": start, "dur": dur}


def trace_events(steps=3, ops=STEP_OPS, replay_of=None):
    """A prefill step at 0, `steps` decode steps from 1000, one more range (not counted).
    replay_of(position) names the CUDA graph replay (1, 2, ...) that ran a step's op, or None
    for an eager op; each replay's ops carry its cudaGraphLaunch's correlation id."""
    events = [step_range("execute_context_1(128)_generation_0(0)", 0, 500)]
    events.append(op_event(MARLIN, "kernel", 0, 400, COMPUTE))
    for index in range(steps + 1):
        start = 1000 + index * STEP_US
        events.append(step_range(DECODE, start, FORWARD_US))
        replays = set()
        for position, (name, cat, begin, end, tid) in enumerate(ops):
            event = op_event(name, cat, start + begin, start + end, tid)
            replay = replay_of(position) if replay_of else None
            if replay is not None:
                replays.add(10 * index + replay)
                event["args"] = {"correlation": 10 * index + replay}
            events.append(event)
        for replay in sorted(replays):
            launch = {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch"}
            events.append({**launch, "ts": start - 50, "dur": 5, "args": {"correlation": replay}})
    # the CPU range of a step and the side stream's copy of one are not step boundaries
    events.append(step_range(DECODE, 1010, 50, cat="user_annotation"))
    events.append(step_range(DECODE, 1030, 4, tid=SIDE))
    events.append({"ph": "i", "cat": "kernel", "name": "instant", "ts": 1001})
    return events


def trace_events_without_gpu_ranges(steps=3):
    """trace_events as a profiler that draws no GPU copies of the ranges would write them: CPU
    ranges (60 us ahead of the GPU) whose launches, matched by correlation id, started the
    forward's ops; the step's later ops are launched after its range."""
    events, correlation = [], 0
    for index in range(steps + 1):
        start = 1000 + index * STEP_US
        events.append(step_range(DECODE, start - 60, 20, cat="user_annotation"))
        for position, (name, cat, begin, end, tid) in enumerate(STEP_OPS):
            correlation += 1
            launch = start - 60 + position if begin < FORWARD_US else start - 30 + position
            api = "cuda_driver" if name == MARLIN else "cuda_runtime"
            events.append({"ph": "X", "cat": api, "name": "launch", "ts": launch, "dur": 0.5,
                           "args": {"correlation": correlation}})  # fmt: skip
            event = op_event(name, cat, start + begin, start + end, tid)
            events.append({**event, "args": {"correlation": correlation}})
    return events


def test_kernels_fall_into_the_step_classes():
    steps, left_out = stepmap.segment(trace_events())
    assert (len(steps), left_out) == (3, 1)
    assert [(s.tokens, s.start, s.forward_end, s.end) for s in steps] == [
        (4, 1000, 1095, 1175),
        (4, 1175, 1270, 1350),
        (4, 1350, 1445, 1525),
    ]
    classes, matched = stepmap.classify(steps[0], FACTS)
    assert matched
    assert classes == [
        "body_gdn_in_proj_qkvz",
        "dense_gemm",
        "gdn",
        "body_gdn_out_proj",
        "norm_activation",
        "body_mlp_gate_up",
        "splits_copies",
        "norm_activation",
        "body_mlp_down",
        "body_attn_qkv",
        "attention",
        "other",
        "body_attn_o",
        "body_mlp_gate_up",
        "body_mlp_down",
        "lm_head",
        "splits_copies",
        "splits_copies",
        "sampling",
        "mtp_drafter_wna16_gemm",
        "mtp_drafter",
        "sampling",
    ]


def test_steps_come_from_the_launches_where_the_trace_has_no_gpu_ranges():
    steps, left_out = stepmap.segment(trace_events_without_gpu_ranges())
    assert left_out == 0
    assert [(s.tokens, s.start, s.forward_end, s.end) for s in steps] == [
        (4, 1000, 1095, 1175),
        (4, 1175, 1270, 1350),
        (4, 1350, 1445, 1525),
    ]
    assert steps == stepmap.segment(trace_events())[0]


def test_per_step_time_classes_and_idle_gaps():
    steps, left_out = stepmap.segment(trace_events())
    summary = stepmap.summarize_steps(steps, FACTS, left_out=left_out)
    assert summary["steps"] == 3 and summary["steps_by_tokens"] == {"4": 3}
    assert summary["gemm_order_matched_steps"] == 3 and summary["forward_gemms_expected"] == 9
    # every op's time, the side stream's copy inside the GEMM too: 97 + 4 us
    assert summary["step_gpu_ms"] == 0.101
    # the union of the ops is 97 us of the 175 us window: 78 us idle, in 18 gaps of 1 us
    # (below the 5 us split) and two host gaps, 40 us before the drafter, 20 us to the next step
    assert summary["step_span_ms"] == 0.175 and summary["step_busy_ms"] == 0.097
    assert summary["idle_ms"] == 0.078
    assert summary["idle_short_gaps_ms"] == 0.018 and summary["idle_long_gaps_ms"] == 0.06
    assert summary["gaps_per_step"] == 20 and summary["launches_per_step"] == 22
    assert summary["long_gaps"] == [
        {
            "before": "rejection_greedy_sample_kernel",
            "after": MARLIN,
            "count_per_step": 1,
            "ms_per_step": 0.04,
        },
        {
            "before": "argmax_kernel",
            "after": "(next step)",
            "count_per_step": 1,
            "ms_per_step": 0.02,
        },
    ]
    classes = {
        name: (c["launches_per_step"], c["ms_per_step"]) for name, c in summary["classes"].items()
    }
    assert classes == {
        "body_gdn_in_proj_qkvz": (1, 0.01),
        "dense_gemm": (1, 0.002),
        "gdn": (1, 0.003),
        "body_gdn_out_proj": (1, 0.005),
        "norm_activation": (2, 0.002),
        "body_mlp_gate_up": (2, 0.02),
        "splits_copies": (3, 0.007),
        "body_mlp_down": (2, 0.002),
        "body_attn_qkv": (1, 0.008),
        "attention": (1, 0.004),
        "other": (1, 0.002),
        "body_attn_o": (1, 0.003),
        "lm_head": (1, 0.02),
        "sampling": (2, 0.003),
        "mtp_drafter_wna16_gemm": (1, 0.008),
        "mtp_drafter": (1, 0.002),
    }
    assert summary["other_kernels"] == [
        {"name": "mystery_kernel_nobody_named", "launches_per_step": 1, "ms_per_step": 0.002}
    ]
    # mlp_down [256, 512] at M = 4: 65536 B of int4, 2048 of scales, 4096 of x, 2048 of y,
    # twice per step in 2 us
    down = summary["gemms"]["4"]["mlp_down"]
    assert down == {
        "launches_per_step": 2,
        "ms_per_step": 0.002,
        "bytes_per_launch": 73728,
        "gbps": 73.7,
    }
    # the int8 lm_head [248320, 256]: 63,569,920 + 993,280 + 2,048 + 1,986,560 B in 20 us
    assert summary["gemms"]["4"]["lm_head"]["bytes_per_launch"] == 66_551_808
    assert summary["gemms"]["4"]["lm_head"]["gbps"] == 3327.6


def test_a_gap_split_moves_gaps_between_short_and_long():
    steps, _ = stepmap.segment(trace_events(steps=1))
    found = stepmap.gaps(steps[0], split_us=30.0)
    assert (found.busy_us, found.short_us, found.long_us, found.count) == (97, 38, 40, 20)
    assert found.long_gaps == (("rejection_greedy_sample_kernel", MARLIN, 40),)


def test_busy_and_idle_time_split_by_cuda_graph_replays():
    """Ops 0-14 but the side stream's copy replay one graph, the drafter's GEMM and attention
    another; the copy, the lm_head, sampling and the argmax run eagerly."""

    def replay_of(position):
        if position < 15 and position != 6:
            return 1
        return 2 if position in (19, 20) else None

    events = trace_events(replay_of=replay_of)
    steps, _ = stepmap.segment(events)
    found = stepmap.gaps(steps[0])
    # graph ops: 61 us of the forward's 14 kernels, 10 of the drafter's two; the eager ones
    # add the lm_head's 20 and 6 of copies, sampling and argmax (the side copy lies inside a
    # GEMM's time)
    assert (found.busy_us, found.graph_busy_us) == (97, 71)
    # 13 gaps of 1 us between the forward graph's kernels, 1 between the drafter's
    assert found.graph_idle_us == 14
    summary = stepmap.summarize_steps(steps, FACTS)
    assert summary["graph_replays_per_step"] == 2
    assert (summary["graph_busy_ms"], summary["graph_idle_ms"]) == (0.071, 0.014)
    assert summary["outside_graphs_busy_ms"] == 0.026
    assert summary["outside_graphs_idle_ms"] == 0.064  # 78 us idle less the graphs' 14
    table = "\n".join(stepmap_cli.format_stepmap(summary, None))
    assert "CUDA graphs: 2.0 replays per step, busy 0.071 ms" in table
    rows = {row.name: row.patched for row in stepmap_cli.stepmap_rows(summary, None, None)}
    assert rows["outside_graphs_idle_ms_per_step"] == 0.064


def test_a_forward_whose_gemms_do_not_match_the_geometry_keeps_them_unnamed():
    ops = [op for index, op in enumerate(STEP_OPS) if index != 8]  # one mlp_down missing
    steps, _ = stepmap.segment(trace_events(steps=2, ops=ops))
    summary = stepmap.summarize_steps(steps, FACTS)
    assert summary["gemm_order_matched_steps"] == 0 and summary["gemms"] == {}
    unmatched = summary["classes"][stepmap.UNMATCHED_GEMMS]
    assert unmatched == {"launches_per_step": 8, "ms_per_step": 0.067}
    assert summary["classes"]["mtp_drafter_wna16_gemm"]["launches_per_step"] == 1  # drafting's


def test_a_trace_without_complete_decode_steps_says_why():
    with pytest.raises(ProfileError, match="no engine step reached the GPU"):
        stepmap.segment([op_event(MARLIN, "kernel", 0, 1, COMPUTE)])
    with pytest.raises(ProfileError, match="profile more steps"):
        stepmap.segment([step_range(DECODE, 0, 5), op_event(MARLIN, "kernel", 0, 1, COMPUTE)])


@pytest.fixture(scope="module")
def config_folders(tmp_path_factory):
    """config.json folders of GEOMETRY as `synth --config-only` writes them: base, prepared."""
    root = tmp_path_factory.mktemp("configs")
    return {
        prepared: synthesize(
            root / str(prepared),
            GEOMETRY,
            config_only=True,
            progress=False,
            edit_quantization=prepared_quantization_edit(GEOMETRY) if prepared else None,
        ).directory
        for prepared in (False, True)
    }


@pytest.mark.parametrize(("prepared", "bits"), [(False, 16), (True, 8)])
def test_model_facts_read_the_served_config(config_folders, prepared, bits):
    config = json.loads((config_folders[prepared] / "config.json").read_text())
    facts = stepmap.model_facts(config)
    assert facts == stepmap.ModelFacts(GEOMETRY, bits)
    # a bf16 lm_head is a dense GEMM: the forward's weight-only GEMMs are the body's alone
    assert len(facts.forward_gemms()) == 8 + (bits < 16)


def test_rows_result_file_and_table(tmp_path):
    steps, _ = stepmap.segment(trace_events())
    summary = stepmap.summarize_steps(steps, FACTS)
    shapes = FACTS.shapes()
    body = [shapes[name] for name in FACTS.forward_gemms()[:-1]]  # the lm_head is last
    body_bytes = sum(moved_bytes(4, shape.n, shape.k) for shape in body)
    rows = {row.name: row for row in stepmap_cli.stepmap_rows(summary, 1000.0, None)}
    assert rows["body_ms_m4"].patched == 0.048  # 10 + 5 + 20 + 2 + 8 + 3 us
    assert rows["body_gbps_m4"].patched == round(body_bytes / 48e-6 / 1e9, 1)
    assert rows["body_bw_fraction_m4"].patched == round(rows["body_gbps_m4"].patched / 1000, 3)
    assert rows["body_mlp_down_bw_fraction_m4"].patched == 0.074  # 73.7 GB/s
    assert rows["lm_head_bw_fraction_m4"].patched == 3.328
    assert rows["idle_ms_per_step"].patched == 0.078 and rows["copy_bandwidth"].patched == 1000
    assert rows["step_ms_other"].unit == "ms" and rows["launches_other"].patched == 1
    assert all(row.stock is None for row in rows.values())
    facts = {
        "gpu": "g",
        "vllm": "v",
        "commit": "c",
        "date": "2026-12-02T00:00:00+0000",
        "command": "hyperqwen bench stepmap",
        "model": "tiny",
    }
    document = stepmap_cli.result_document(summary, list(rows.values()), facts, tmp_path / "t")
    path = tmp_path / "map.json"
    path.write_text(json.dumps(document))
    validate_result(json.loads(path.read_text()), "map")
    # a second map of the same trace, against the first: stock is the first's value
    again = stepmap_cli.stepmap_rows(summary, 1000.0, json.loads(path.read_text()))
    assert all(row.stock == row.patched and row.ratio in (1.0, None) for row in again)
    table = "\n".join(stepmap_cli.format_stepmap(summary, 1000.0))
    assert "mystery_kernel_nobody_named" in table and "rejection_greedy_sample_kernel ->" in table
    assert "lm_head" in table and "0.074" in table  # mlp_down's fraction of copy


def test_the_command_maps_a_saved_trace(tmp_path, capsys, config_folders):
    from hyperqwen.cli import main

    trace = tmp_path / "worker.pt.trace.json.gz"
    with gzip.open(trace, "wt") as handle:
        json.dump({"traceEvents": trace_events()}, handle)
    assert load_trace(trace)
    folder = config_folders[True]
    out = tmp_path / "map.json"
    argv = ["bench", "stepmap", "--trace", str(trace), "--model-dir", str(folder)]
    argv += ["--copy-gbps", "2000", "--out", str(out), "--commit", "test"]
    assert main(argv) == 0
    rows = {row["name"]: row for row in json.loads(out.read_text())["rows"]}
    assert rows["step_gpu_ms"]["patched"] == 0.101 and rows["steps"]["patched"] == 3
    printed = capsys.readouterr()
    assert "body_mlp_gate_up" in printed.out
    # one CPU step range in this trace: no host window, the GPU's map stands alone
    assert "no host map" in printed.err and "profiled_host_window_ms" not in rows
    with gzip.open(trace, "wt") as handle:  # CPU ranges every 175 us, launches in them
        json.dump({"traceEvents": trace_events_without_gpu_ranges()}, handle)
    assert main(argv) == 0
    rows = {row["name"]: row for row in json.loads(out.read_text())["rows"]}
    assert rows["profiled_host_window_ms"]["patched"] == STEP_US / 1000
    assert "host step thread, per step (3 windows)" in capsys.readouterr().out
    assert main(["bench", "stepmap", "--trace", str(trace)]) == 2  # no --model-dir
    nowhere = ["--model-dir", str(tmp_path / "nowhere"), "--out", str(tmp_path / "no.json")]
    assert main(["bench", "stepmap", "--trace", str(trace), *nowhere]) == 1
    assert "nowhere/config.json" in capsys.readouterr().err
    assert not (tmp_path / "no.json").exists()


def test_server_flags_ask_for_one_range_more_than_the_steps(tmp_path, capsys):
    from hyperqwen.cli import main

    assert (
        main(["bench", "stepmap", "--server-flags", "--trace-dir", str(tmp_path), "--steps", "5"])
        == 0
    )
    flag, value = shlex.split(capsys.readouterr().out)
    config = json.loads(value)
    assert flag == "--profiler-config" and config["torch_profiler_dir"] == str(tmp_path)
    assert (config["delay_iterations"], config["max_iterations"]) == (PROFILE_DELAY_STEPS, 6)


def test_the_command_profiles_a_running_server(tmp_path, config_folders, monkeypatch):
    """Against the stand-in server of `bench ab`'s tests (tests/openai_test_server.py), which
    writes a trace of its own on /stop_profile: each step one Marlin GEMM (10 us) and one
    unnamed kernel (5 us), starting together."""
    for name in ("VLLM_API_KEY", "PORT", "API_KEY_FILE", "ENV_FILE"):
        monkeypatch.delenv(name, raising=False)
    behaviour = {"startup_s": 0, "weight_gib": 1, "prefill_ms": 1, "step_ms": 1}
    behaviour["kernels_us"] = {MARLIN: 10.0, "mystery_kernel_nobody_named": 5.0}
    fake = tmp_path / "fake.json"
    fake.write_text(json.dumps({"patched": behaviour}))
    trace_dir, out, env_file = tmp_path / "trace", tmp_path / "map.json", tmp_path / "empty.env"
    env_file.write_text("")
    spec = json.dumps({"method": "mtp", "num_speculative_tokens": 3})
    argv = ["--fake-config", str(fake), "--side", "patched", "serve", str(config_folders[True])]
    argv += ["--port", "1", "--served-model-name", "q27p", "--speculative-config", spec]
    args, behaviour = parse_args(argv + server_flags(trace_dir, 3))
    with serving(build_app(args, behaviour)) as port:
        command = ["bench", "stepmap", "--url", f"http://127.0.0.1:{port}"]
        command += ["--env-file", str(env_file), "--trace-dir", str(trace_dir), "--steps", "3"]
        assert run_in_process(*command, "--copy-gbps", "1000", "--out", str(out)) == 0
    document = json.loads(out.read_text())
    summary = document["stepmap"]
    # 4 ranges (3 steps + the one that ends the last): the model folder came from /v1/models
    assert summary["steps"] == 3 and summary["forward_gemms_expected"] == 9
    assert summary["gemm_order_matched_steps"] == 0  # one GEMM a step is not the geometry's 9
    assert summary["step_gpu_ms"] == 0.015 and summary["step_busy_ms"] == 0.01
    assert summary["idle_ms"] == 0.99  # the stand-in's steps are 1000 us apart
    assert Path(document["trace"]).parent == trace_dir
    assert document["vllm"].startswith("0.26.0 (patched test server) served")
    assert document["model"].startswith("q27p at http://127.0.0.1:")

"""`hyperqwen bench gdn` without a GPU: its cases' inputs, its config sweep and the rows it
computes from raw timings (the timing itself needs a GPU: `hyperqwen bench gdn` there)."""

from __future__ import annotations

import pytest
import torch
from cli_runner import run_in_process

from hyperqwen.bench.gdn import configs_for, make_case, result_rows, state_bytes
from hyperqwen.bench.timing import L2_ROTATION_BYTES
from hyperqwen.checkpoint.geometry import PRESETS


def test_each_launch_updates_its_own_slots_and_together_they_outgrow_l2() -> None:
    tiny = PRESETS["tiny"]
    inputs, state, indices, accepted, copies = make_case(tiny, 2, 4, device="cpu")
    assert indices.shape == (copies, 2, 4) and accepted.tolist() == [4, 4]
    slots = indices.flatten().tolist()
    assert len(set(slots)) == len(slots) and min(slots) == 1  # slot 0 is vLLM's null block
    assert state.shape[0] == 1 + len(slots)
    assert copies * indices[0].numel() * state[0].numel() * 4 >= L2_ROTATION_BYTES
    assert inputs["cu_seqlens"].tolist() == [0, 4, 8]
    assert inputs["q"].abs().sum() > 0 and state.abs().sum() > 0
    _, _, decode_indices, no_accepted, _ = make_case(tiny, 3, 1, device="cpu")
    assert decode_indices.dim() == 2 and no_accepted is None  # decode: 1-D indices per launch


def test_configs_sweep_blocks_warps_and_passes() -> None:
    assert {c["tokens_per_pass"] for c in configs_for(4)} == {4}
    assert {c["tokens_per_pass"] for c in configs_for(16)} == {4, 16}
    assert {c["tokens_per_pass"] for c in configs_for(1)} == {1}
    assert len(configs_for(4)) == 9


def test_rows_take_our_fastest_correct_config_and_count_the_state_moved() -> None:
    raw = {
        "v_heads": 48,
        "head_dim": 128,
        "copy_gbps": 4232.4,
        "cases": {
            "verify_n1_t4": {
                "sequences": 1,
                "tokens": 4,
                "vllm_us": 11.6,
                "ours": {
                    "b8_w1_p4": {"us": 4.0, "out_error": 1e-3},
                    "b8_w2_p4": {"error": "out 5.00e-01, state 1.00e+00"},
                    "b16_w1_p4": {"us": 5.0, "out_error": 1e-3},
                },
            },
            "verify_n2_t4": {  # the served config (16 rows, one warp) is not the fastest here
                "sequences": 2,
                "tokens": 4,
                "vllm_us": 16.0,
                "ours": {
                    "b8_w1_p4": {"us": 12.0, "out_error": 1e-3},
                    "b16_w1_p4": {"us": 13.0, "out_error": 1e-3},
                },
            },
        },
    }
    rows = {row["name"]: row for row in result_rows(raw)}
    assert (rows["gdn_verify_n1_t4"]["stock"], rows["gdn_verify_n1_t4"]["patched"]) == (11.6, 4.0)
    assert rows["gdn_verify_n1_t4"]["ratio"] == round(4.0 / 11.6, 3)
    moved = state_bytes(48, 128, 4)
    assert moved == 48 * 128 * 128 * 4 * 5
    assert rows["gdn_verify_n1_t4_moved"]["patched"] == round(moved / 4e-6 / 1e9, 1)
    assert rows["copy_bandwidth"]["stock"] == 4232
    # what serving launches beside the sweep's best: one sequence 8 rows, two 16
    assert rows["gdn_verify_n1_t4_served"]["patched"] == 4.0
    assert (rows["gdn_verify_n2_t4"]["patched"], rows["gdn_verify_n2_t4_served"]["patched"]) == (
        12.0,
        13.0,
    )


def test_without_a_gpu_it_says_so(capsys) -> None:
    assert run_in_process("bench", "gdn", "--out", "unused.json") == 3
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the interpreter's, per scalar
def test_every_config_passes_the_check_against_vllm_though_timing_moves_the_state():
    """measure_case's own check, on the CPU interpreter: the timer runs launches that update
    the state slots in place (as CUDA-graph replays do), and every config of ours must still
    be checked from the state vLLM's reference started from."""
    from test_kernel_gdn_recurrent import vllms_kernel

    from hyperqwen.bench.gdn import measure_case

    ran = []

    def timer(launches):  # what graph_time_us does to the state, without a GPU
        launches[0]()
        ran.append(len(launches))
        return 1.0

    device = "cuda" if torch.cuda.is_available() else "cpu"  # compiled there, interpreted here
    entry = measure_case(
        PRESETS["tiny"], "verify_n1_t4", 1, 4, print, timer=timer, device=device,
        vllms=vllms_kernel(),
    )  # fmt: skip
    assert entry["vllm_us"] == 1.0 and ran[0] == entry["copies"] >= 2
    assert len(entry["ours"]) == len(configs_for(4))
    failed = {label: e for label, e in entry["ours"].items() if "us" not in e}
    assert not failed, failed
    assert all(e["out_error"] < 1e-2 for e in entry["ours"].values())

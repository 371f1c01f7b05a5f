"""`hyperqwen bench kernels` without a GPU: the shapes it times and the rows it writes."""

from __future__ import annotations

import pytest
from cli_runner import run_in_process

from hyperqwen.bench.kernels import (
    head_shapes,
    layer_shapes,
    moved_bytes,
    result_document,
    result_rows,
    sweep_configs,
)
from hyperqwen.bench.results import validate_result
from hyperqwen.checkpoint.geometry import PRESETS


def test_head_shapes_are_the_verify_and_draft_heads_at_8_bits():
    heads = {s.name: (s.n, s.k, s.bits) for s in head_shapes(PRESETS["27b"])}
    assert heads == {"lm_head": (248_320, 5120, 8), "draft_head": (40_960, 5120, 8)}
    assert (
        moved_bytes(1, 40_960, 5120, bits=8)
        == 40_960 * 5120 + 40_960 * 40 * 2 + 5120 * 2 + 40_960 * 2
    )


def test_27b_shapes_are_the_fused_linears_a_token_runs():
    shapes = {s.name: (s.n, s.k, s.per_token) for s in layer_shapes(PRESETS["27b"])}
    assert shapes == {
        "gdn_in_proj_qkvz": (16384, 5120, 48),
        "gdn_out_proj+attn_o": (5120, 6144, 64),  # same shape: timed once, counted for both
        "attn_qkv": (14336, 5120, 16),
        "mlp_gate_up": (34816, 5120, 64),
        "mlp_down": (5120, 17408, 64),
    }
    int4_bytes = sum(n * k // 2 * count for n, k, count in shapes.values())
    assert int4_bytes == 12_163_481_600  # the ~12.2 GB a C1 token reads through its body


def fake_entry(n: int, k: int, m: int, machete_us: float, marlin_us: float, ours_us: list):
    return {
        "bytes": moved_bytes(m, n, k),
        "vllm": {"machete": {"us": machete_us}, "marlin": {"us": marlin_us}, "triton": {}},
        "ours": [{"config": {}, "us": us} for us in ours_us] + [{"config": {}, "error": "x"}],
    }


def test_rows_give_bandwidth_per_candidate_and_the_body_fraction():
    raw = {
        "gpu": "test GPU",
        "date": "2026-12-01T10:00:00+0000",
        "preset": "27b",
        "copy_gbps": 4000.0,
        "shapes": [
            {"name": "a", "n": 1024, "k": 2048, "per_token": 3,
             "m": {"1": fake_entry(1024, 2048, 1, 2.0, 1.0, [4.0, 3.0])}},
            {"name": "b", "n": 2048, "k": 1024, "per_token": 1,
             "m": {"1": fake_entry(2048, 1024, 1, 1.0, 1.0, [2.0])}},
        ],
    }  # fmt: skip
    document = result_document(raw, "hyperqwen bench kernels", "abc123", "vLLM 0.26.0")
    rows = {row.name: row for row in validate_result(document, "test")}
    nbytes = moved_bytes(1, 1024, 2048)
    assert rows["a_m1_marlin"].patched == round(nbytes / 1e-6 / 1e9, 1)
    assert rows["a_m1_marlin"].stock == round(nbytes / 2e-6 / 1e9, 1)
    assert rows["a_m1_hyperqwen"].patched == round(nbytes / 3e-6 / 1e9, 1)  # fastest config
    body_bytes = 3 * nbytes + moved_bytes(1, 2048, 1024)
    marlin_fraction = body_bytes / ((3 * 1.0 + 1.0) * 1e-6) / 1e9 / 4000.0
    machete_fraction = body_bytes / ((3 * 2.0 + 1.0) * 1e-6) / 1e9 / 4000.0
    assert rows["body_bw_fraction_m1_marlin"].patched == round(marlin_fraction, 3)
    assert rows["body_bw_fraction_m1_marlin"].stock == round(machete_fraction, 3)
    assert rows["body_bw_fraction_m1_triton"].patched is None  # not measured stays unmeasured
    assert rows["copy_bandwidth"].stock == 4000
    assert document["raw"] is raw
    assert not any(name.startswith("lm_head") for name in rows)  # no head was timed


def test_head_rows_compare_int8_kernels_with_the_bf16_head_in_ms():
    head = fake_entry(4096, 512, 1, machete_us=30.0, marlin_us=20.0, ours_us=[])
    head["vllm"]["bf16_torch"] = {"us": 50.0}
    raw = {
        "gpu": "test GPU", "date": "2026-12-01T10:00:00+0000", "preset": "27b",
        "copy_gbps": 4000.0,
        "shapes": [
            {"name": "a", "n": 1024, "k": 2048, "per_token": 1,
             "m": {"1": fake_entry(1024, 2048, 1, 2.0, 1.0, [4.0])}},
            {"name": "lm_head", "n": 4096, "k": 512, "per_token": 1, "bits": 8, "m": {"1": head}},
        ],
    }  # fmt: skip
    rows = {row.name: row for row in validate_result(result_document(raw, "c", "x", "v"), "t")}
    assert rows["lm_head_m1_int8_marlin"].unit == "ms"
    assert (rows["lm_head_m1_int8_marlin"].stock, rows["lm_head_m1_int8_marlin"].patched) == (
        0.05,
        0.02,
    )
    assert rows["lm_head_m1_int8_machete"].ratio == 0.6
    # heads stay out of the body's bandwidth fraction
    body_bytes = moved_bytes(1, 1024, 2048)
    assert rows["body_bw_fraction_m1_marlin"].patched == round(body_bytes / 1e-6 / 1e9 / 4000, 3)


def test_sweep_stays_within_the_kernels_limits():
    from hyperqwen.kernels.w4a16 import check_config

    for config in sweep_configs():
        check_config(config, 128, 5120)


def test_without_a_gpu_it_stops_and_says_so(capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert run_in_process("bench", "kernels", "--backends") == 3
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_published_kernel_rows_are_what_the_code_computes_from_their_raw_timings():
    import json
    from pathlib import Path

    published = sorted(
        (Path(__file__).parents[1] / "docs" / "results").glob("*-w4a16-kernels.json")
    )
    assert published, "no published kernel run"
    for path in published:
        document = json.loads(path.read_text())
        assert result_rows(document["raw"]) == document["rows"], path.name


def test_rows_without_machete_have_no_stock_side():
    entry = {"bytes": moved_bytes(1, 64, 256), "vllm": {"marlin": {"us": 1.0}}, "ours": []}
    raw = {"copy_gbps": 4000.0, "shapes": [
        {"name": "a", "n": 64, "k": 256, "per_token": 1, "m": {"1": entry}}]}  # fmt: skip
    rows = {row["name"]: row for row in result_rows(raw)}
    assert rows["body_bw_fraction_m1_marlin"]["stock"] is None
    assert rows["body_bw_fraction_m1_marlin"]["patched"] == round(
        moved_bytes(1, 64, 256) / 1e-6 / 1e9 / 4000.0, 3
    )
    assert rows["a_m1_marlin"]["stock"] is None

"""`hyperqwen bench capacity` on the CPU: vLLM 0.26's sizing lines parsed, GPU_UTIL for a
budget, which choices serve with MTP, each side's argv per choice, and the result rows (checked
by the published-results validator). The servers themselves run on the GPU host only."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import pytest

from hyperqwen.bench.capacity_rows import (
    BUDGET_GIB,
    DEFAULT_VLLM_ARGS,
    PART_ROWS,
    CapacityRunError,
    choice_rows,
    patched_knobs,
    patched_settings,
    plan_choices,
    result_document,
    serve_and_read,
    shared_gpu_notes,
    sized_side,
    state_gib_per_slot,
    step_note,
    stock_argv,
)
from hyperqwen.bench.capacity_serve import (
    USAGE_LINE,
    VllmSizing,
    gpu_util_for_budget,
    parse_sizing,
    served_until_logged,
)
from hyperqwen.bench.results import validate_result
from hyperqwen.capacity import CUDA_UNREPORTED_BYTES, PREPARED_27B_WEIGHT_BYTES, GiB, Machine, MiB
from hyperqwen.checkpoint.geometry import PRESETS
from hyperqwen.cli import build_parser
from hyperqwen.gpu import Gpu
from hyperqwen.kv_choices import KV_CHOICES, KVARN_CHOICE
from hyperqwen.launch import build_launch
from hyperqwen.settings import load_settings
from hyperqwen.vllm_flags import flag_value

H200_BYTES = 143_771 * MiB  # nvidia-smi's memory.total
H200 = Gpu(0, "NVIDIA H200", (9, 0), H200_BYTES / GiB, "570.00", "700.00 W")
RTX_3090 = Gpu(0, "NVIDIA GeForce RTX 3090", (8, 6), 24.0, "570.00", "350.00 W")
SERVED = [kv for kv in KV_CHOICES if not kv.startswith("turboquant_")]

# As vLLM 0.26's engine core logs them (kv_cache_utils.py, gpu_worker.py), numbers invented.
LOG = """\
(EngineCore pid=4711) INFO 12-03 08:10:02 [gpu_model_runner.py:4400] Model loading took 15.31 GiB memory and 9.1 seconds
(EngineCore pid=4711) INFO 12-03 08:10:40 [gpu_worker.py:561] Available KV cache memory: 5.37 GiB
(EngineCore pid=4711) INFO 12-03 08:10:41 [kv_cache_utils.py:2177] GPU KV cache size: 301,312 tokens
(EngineCore pid=4711) INFO 12-03 08:10:41 [kv_cache_utils.py:2179] Maximum concurrency for 262,144 tokens per request: 1.15x
(EngineCore pid=4711) INFO 12-03 08:11:30 [gpu_worker.py:860] Free memory on device (139.2/139.8 GiB) on startup. Desired GPU memory utilization is (0.1716, 23.99 GiB). Actual usage is 15.31 GiB for weight, 1.74 GiB for peak activation, 0.38 GiB for non-torch memory, and 0.61 GiB for CUDAGraph memory. Replace gpu_memory_utilization config with `--kv-cache-memory=5661573120` (5.27 GiB) to fit into requested memory, or `--kv-cache-memory=123` (0.0 GiB) to fully utilize gpu memory. Current kv cache memory in use is 5.37 GiB.
"""  # noqa: E501


def test_a_complete_log_gives_every_part():
    sizing = parse_sizing(LOG)
    assert sizing == VllmSizing(
        cache_tokens=301_312,
        max_len=262_144,
        concurrency=1.15,
        pool_gib=5.37,
        weight_gib=15.31,
        activation_gib=1.74,
        non_torch_gib=0.38,
        graph_gib=0.61,
    )
    assert sizing.complete


def test_the_step_a_side_served_at_is_read_from_vllms_non_default_args():
    """vLLM lists the flags it was given; without --max-num-batched-tokens, its default."""
    given = (
        "(APIServer pid=4700) INFO 12-03 08:09:50 [api_utils.py:273] non-default args: "
        "{'model_tag': '/tmp/q27p', 'max_model_len': 97280, 'max_num_batched_tokens': 2048, "
        "'max_num_seqs': 1}\n"
    )
    patched = parse_sizing(given + LOG)
    stock = parse_sizing(given.replace("'max_num_batched_tokens': 2048, ", "") + LOG)
    assert (patched.step_tokens, stock.step_tokens, parse_sizing(LOG).step_tokens) == (
        2048,
        None,
        None,
    )
    assert step_note("fp8", patched, stock) == (
        "capacity_fp8: tokens per step (--max-num-batched-tokens): patched 2,048, stock "
        "vLLM's default"
    )
    assert step_note("kvarn", patched, None).endswith("patched 2,048, stock not served")


def test_a_log_cut_before_graph_capture_is_incomplete():
    cut = LOG[: LOG.index("Free memory on device")]
    sizing = parse_sizing(cut)
    assert sizing.cache_tokens == 301_312 and sizing.graph_gib is None
    assert not sizing.complete
    assert not parse_sizing("").complete


def test_the_launchers_expected_size_is_not_read_as_vllms():
    # `hyperqwen serve` prints its estimate before vLLM starts; the H200's KV=fp8 run of
    # 2026-12-03 published that estimate (584,320) where vLLM had logged 176,000
    note = (
        "note: CTX=huge: this card holds 176,000 tokens at 1 slot (...). vLLM should log "
        "'GPU KV cache size: 584,320 tokens' and 3.32x concurrency.\n"
    )
    sizing = parse_sizing(note + LOG)
    assert (sizing.cache_tokens, sizing.concurrency) == (301_312, 1.15)
    assert parse_sizing(note).cache_tokens is None


def test_a_negative_non_torch_share_is_read_and_named_as_a_shared_gpu():
    # the H200's KV=kvarn run of 2026-12-03 beside other servers logged this: the line must
    # still end the run (it is the line the server is stopped on) and say what it means
    shared = LOG.replace("0.38 GiB for non-torch", "-1.37 GiB for non-torch")
    assert USAGE_LINE.search(shared)
    sizing = parse_sizing(shared)
    assert sizing.complete and sizing.non_torch_gib == -1.37
    (note,) = shared_gpu_notes("kvarn", "patched", sizing)
    assert note.startswith("capacity_kvarn (patched): vLLM logged -1.37 GiB") and "idle" in note
    assert shared_gpu_notes("fp8", "patched", parse_sizing(LOG)) == []
    assert shared_gpu_notes("fp8", "stock", None) == []


def test_gpu_util_requests_the_budget_and_never_more():
    util = gpu_util_for_budget(BUDGET_GIB * GiB, H200_BYTES)
    requested = (H200_BYTES - CUDA_UNREPORTED_BYTES) * util
    assert requested <= BUDGET_GIB * GiB
    # rounded down to 4 decimals: at most 1e-4 of the card under the budget
    assert BUDGET_GIB * GiB - requested < 1e-4 * H200_BYTES


def test_turboquant_is_refused_with_mtp_and_kvarn_has_no_stock():
    plans = {plan.kv: plan for plan in plan_choices(list(KV_CHOICES), [H200])}
    for kv, plan in plans.items():
        refused = kv.startswith("turboquant_")
        assert (plan.refusal is not None) is refused, kv
        assert not refused or "SPEC=mtp" in plan.refusal
        assert plan.has_stock is (kv != KVARN_CHOICE)
    below_ada = plan_choices(["fp8_per_token_head", "int8_per_token_head"], [RTX_3090])
    assert "compute capability 8.9" in below_ada[0].refusal
    assert below_ada[1].refusal is None


@pytest.mark.parametrize("kv", SERVED)
def test_the_patched_argv_serves_one_slot_with_mtp_in_the_budget(tmp_path, kv):
    util = gpu_util_for_budget(BUDGET_GIB * GiB, H200_BYTES)
    knobs = patched_knobs(kv, tmp_path, util, 18123, DEFAULT_VLLM_ARGS)
    loaded = load_settings(knobs, env_file=tmp_path / "no.env")
    machine = Machine(H200_BYTES, "H200", PRESETS["27b"], PREPARED_27B_WEIGHT_BYTES, "27B")
    argv = build_launch(loaded, "single", api_key=None, machine=machine).argv
    assert flag_value(argv, "--gpu-memory-utilization") == str(util)
    assert flag_value(argv, "--max-num-seqs") == "1"
    assert flag_value(argv, "--kv-cache-dtype") == KV_CHOICES[kv].vllm_cache_dtype
    assert json.loads(flag_value(argv, "--speculative-config"))["method"] == "mtp"
    assert flag_value(argv, "--load-format") == "dummy"
    # sized for 24 GiB, not the H200's 140: the 27B's fp8 cache then holds less than 1M tokens
    assert 4096 <= int(flag_value(argv, "--max-model-len")) <= 262144


@pytest.mark.parametrize("kv", [kv for kv in SERVED if kv != KVARN_CHOICE])
def test_the_stock_argv_matches_the_patched_cache_knobs(tmp_path, kv):
    knobs = patched_knobs(kv, tmp_path, 0.1716, 18123, DEFAULT_VLLM_ARGS)
    settings = patched_settings(knobs, tmp_path)
    argv = stock_argv(settings, tmp_path / "q27", 200704, 18124)
    assert argv[:5] == [
        sys.executable,
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        str(tmp_path / "q27"),
    ]
    assert flag_value(argv, "--gpu-memory-utilization") == "0.1716"
    assert flag_value(argv, "--max-model-len") == "200704"
    assert flag_value(argv, "--max-num-seqs") == "1"
    assert flag_value(argv, "--kv-cache-dtype") == kv
    assert flag_value(argv, "--attention-backend") == KV_CHOICES[kv].attention_backend
    # stock's own keys only: draft_sample_method is HyperQwen's
    spec = {"method": "mtp", "num_speculative_tokens": 3}
    assert json.loads(flag_value(argv, "--speculative-config")) == spec
    assert "--enable-prefix-caching" in argv and "--language-model-only" in argv
    assert flag_value(argv, "--additional-config") == '{"gdn_prefill_backend":"triton"}'


def test_rows_of_a_measured_choice_pass_the_results_check(tmp_path):
    patched = parse_sizing(LOG)
    stock = parse_sizing(LOG.replace("301,312", "250,000").replace("1.74 GiB", "2.1 GiB"))
    settings = patched_settings(patched_knobs("fp8", tmp_path, 0.17, 1, ""), tmp_path)
    state = state_gib_per_slot(settings)
    rows = choice_rows("fp8", patched, stock, state)
    refused = choice_rows("turboquant_k8v4", None, None, None)
    kvarn = choice_rows(KVARN_CHOICE, patched, None, state)
    names = [row.name for row in rows]
    assert names == ["capacity_fp8"] + [f"capacity_fp8_{suffix}" for suffix, _ in PART_ROWS] + [
        "capacity_fp8_concurrency",
        "capacity_fp8_max_len",
        "capacity_fp8_state_computed",
    ]
    head = rows[0]
    assert (head.unit, head.stock, head.patched, head.ratio) == ("tokens", 250000, 301312, 1.205)
    assert [(row.stock, row.patched) for row in refused] == [(None, None)]
    assert all(row.stock is None and row.ratio is None for row in kvarn)
    assert state > 0
    args = argparse.Namespace(
        budget_gib=24.0, stock_vllm="vllm", commit="abc1234", started="2026-12-03T08:00:00+0000"
    )
    document = result_document(args, H200, 0.1716, [*rows, *refused, *kvarn], ["a note"])
    checked = validate_result(json.loads(json.dumps(document)), "capacity.json")
    assert len(checked) == len(document["rows"]) == 9 + 1 + 9


def test_an_unknown_kv_choice_is_refused_naming_the_choices(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "capacity", "--kv", "fp8,fp4"])
    error = capsys.readouterr().err
    assert "fp4" in error and "int4_per_token_head" in error


# vLLM 0.26's refusal, as its engine core logs it (kv_cache_utils.py), numbers invented
REFUSAL = (
    "(EngineCore pid=4711) ERROR 12-03 08:10:41 [core.py:1100] ValueError: To serve at "
    "least one request with the model's max seq len (262144), (6.1 GiB KV cache is needed, "
    "which is larger than the available KV cache memory (5.2 GiB). Based on the available "
    "memory, the estimated maximum model length is 223360. Try increasing "
    "`gpu_memory_utilization` (which also controls CPU memory on the CPU backend) or "
    "decreasing `max_model_len` when initializing the engine."
)


def test_a_length_vllm_refuses_names_the_knob_and_what_fits(tmp_path):
    command = ["python3", "-c", f"print({REFUSAL!r})"]
    with pytest.raises(CapacityRunError, match=r"holds at most 223,360 .* --max-len 223360"):
        serve_and_read(command, {}, tmp_path / "refused.log", 30, "KV=fp8 patched")
    knobs = patched_knobs("fp8", tmp_path, 0.17, 1, "", max_len=223360)
    assert patched_settings(knobs, tmp_path).MAX_LEN == 223360


def test_a_refused_length_is_served_again_at_the_longest_vllm_names(tmp_path):
    lengths = []

    def at(max_len):  # a "server" that refuses any length but the one vLLM named
        lengths.append(max_len)
        text = LOG.replace("262,144", "223,360") if max_len == 223360 else REFUSAL
        return ["python3", "-c", f"print({text!r})"], {}

    notes = []
    sizing = sized_side(at, None, tmp_path / "fp8-stock", 30, "KV=fp8 stock", notes)
    assert lengths == [None, 223360]
    assert (sizing.cache_tokens, sizing.max_len, sizing.concurrency) == (301_312, 223_360, 1.15)
    assert "refused max_model_len 262144" in notes[0] and notes[1].endswith("max_model_len 223360")
    assert (tmp_path / "fp8-stock.log").is_file() and (tmp_path / "fp8-stock-refit.log").is_file()


def test_a_second_refusal_gives_up_with_both_in_the_notes(tmp_path):
    def at(max_len):
        return ["python3", "-c", f"print({REFUSAL!r})"], {}

    notes = []
    assert sized_side(at, 100_000, tmp_path / "fp8-patched", 30, "KV=fp8 patched", notes) is None
    assert sum("refused max_model_len" in note for note in notes) == 2


def test_a_server_that_exits_early_leaves_its_log(tmp_path):
    log = tmp_path / "server.log"
    command = ["python3", "-c", "print('Available KV cache memory: 1.5 GiB')"]
    text = served_until_logged(command, {}, log, USAGE_LINE, timeout_s=30)
    assert parse_sizing(text).pool_gib == 1.5 and not parse_sizing(text).complete
    assert Path(log).read_text() == text


def test_a_vllm_tree_goes_first_on_the_servers_path(tmp_path):
    from hyperqwen.bench.capacity_rows import vllm_first

    assert vllm_first(None, {"KV": "fp8"}) == {"KV": "fp8"}
    env = vllm_first(tmp_path / "stock", {"KV": "fp8"})
    first, second = env["PYTHONPATH"].split(os.pathsep)[:2]
    assert (first, env["KV"]) == (str(tmp_path / "stock"), "fp8")
    assert Path(second, "hyperqwen", "cli.py").is_file()  # the checkout's package behind it

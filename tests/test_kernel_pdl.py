"""Programmatic dependent launch (the PDL knob, engine/pdl.py and kernels/pdl.py): which cards
launch with it, the knob's refusals, what each launcher hands Triton, and where the compiled
kernels wait, prefetch and release. That the kernels give the same bits with their PDL code on
is checked beside each kernel's float64 test (tests/test_kernel_*.py); under CUDA-graph replay
in a chain, by tests/test_kernel_pdl_gpu.py."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_runner import ROOT, hyperqwen, path_with_nvidia_smi

from hyperqwen.engine import pdl as knob
from hyperqwen.engine.features import PDL, FeatureSwitchError
from hyperqwen.gpu import parse_smi_line
from hyperqwen.kernels import ba_proj, gdn_recurrent, split_qkv, w4a16
from hyperqwen.kernels.pdl import launch_with_pdl
from hyperqwen.settings import Settings, SettingsError, load_settings

RTX_3090 = parse_smi_line("0, NVIDIA GeForce RTX 3090, 8.6, 24576, 560.35, 350.00")
RTX_4090 = parse_smi_line("1, NVIDIA GeForce RTX 4090, 8.9, 24564, 560.35, 450.00")
H200 = parse_smi_line("0, NVIDIA H200, 9.0, 143771, 580.95, 700.00")
RTX_5090 = parse_smi_line("0, NVIDIA GeForce RTX 5090, 12.0, 32607, 575.51, 575.00")
A100 = parse_smi_line("0, NVIDIA A100-SXM4-80GB, 8.0, 81920, 560.35, 400.00")
CARDS = [A100, RTX_3090, RTX_4090, H200, RTX_5090]


@pytest.fixture(autouse=True)
def fresh_decisions():
    """for_capability keeps one decision per card for the process; each test starts afresh."""
    knob.for_capability.cache_clear()
    yield
    knob.for_capability.cache_clear()


@pytest.mark.parametrize("card", CARDS, ids=lambda card: card.sm)
def test_only_sm90_and_newer_launch_with_pdl(card):
    hopper_or_newer = card.compute_capability >= (9, 0)
    assert knob.decide("auto", card.compute_capability) is hopper_or_newer
    assert knob.decide("1", card.compute_capability) is hopper_or_newer
    assert knob.decide("0", card.compute_capability) is False


def test_the_process_reads_the_variable_unset_as_off(monkeypatch, caplog):
    monkeypatch.delenv(PDL.env, raising=False)
    assert knob.for_capability((9, 0)) is False  # off by default until measured
    knob.for_capability.cache_clear()
    monkeypatch.setenv(PDL.env, "auto")
    assert knob.for_capability((9, 0)) is True and knob.for_capability((8, 9)) is False
    assert not caplog.records  # auto below sm90 is silent
    knob.for_capability.cache_clear()
    monkeypatch.setenv(PDL.env, "1")
    with caplog.at_level(logging.WARNING):
        assert knob.for_capability((8, 6)) is False
        assert knob.for_capability((8, 6)) is False  # logged once per card
    (record,) = caplog.records
    assert "HYPERQWEN_PDL: PDL=1 needs compute capability 9.0" in record.getMessage()
    assert "this card is sm86: launched without PDL" in record.getMessage()
    knob.for_capability.cache_clear()
    monkeypatch.setenv(PDL.env, "on")
    with pytest.raises(FeatureSwitchError, match="HYPERQWEN_PDL='on': expected one of auto, 0, 1"):
        knob.for_capability((9, 0))


def test_the_knob_takes_auto_0_1_and_refuses_others_by_name(tmp_path):
    assert Settings().PDL == "0"
    absent = tmp_path / "absent.env"
    for value in ("auto", "0", "1"):
        loaded = load_settings({"PDL": value}, absent)
        assert value == loaded.settings.PDL
    with pytest.raises(SettingsError, match="PDL"):
        load_settings({"PDL": "yes"}, absent)


def test_serve_refuses_pdl_1_on_a_card_below_sm90_by_name():
    message = knob.serve_refusal("1", [H200, RTX_3090], Path())
    assert message.startswith("PDL=1 needs compute capability 9.0 or newer")
    assert "this machine has NVIDIA GeForce RTX 3090 (sm86). Use" in message
    assert "Use PDL=auto (on where the card has it) or PDL=0." in message
    assert knob.serve_refusal("1", [H200, RTX_5090], Path()) is None
    assert (
        knob.serve_refusal("auto", CARDS, Path()) is None
        and knob.serve_refusal("0", CARDS, Path()) is None
    )


def test_the_refusal_comes_before_vllm_through_the_cli(tmp_path):
    path = path_with_nvidia_smi(tmp_path, "0, NVIDIA GeForce RTX 4090, 8.9, 24564, 560.35, 450.00")
    env = {"PDL": "1", "PRINT_ARGV": "1", "PATH": path}
    done = hyperqwen("serve", "single", env=env, cwd=tmp_path)
    assert done.returncode == 2
    assert "refusing to start: PDL=1 needs compute capability 9.0" in done.stderr
    env["PDL"] = "auto"
    assert hyperqwen("serve", "single", env=env, cwd=tmp_path).returncode == 0


def test_a_launch_asks_the_knob_for_the_card_and_refuses_pdl_where_it_cannot_run(monkeypatch):
    """No card here: torch reports the capability of a stand-in one."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setenv(PDL.env, "auto")
    for capability, expected in [((8, 6), False), ((8, 9), False), ((9, 0), True)]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device, c=capability: c)
        assert launch_with_pdl(cuda, None) is expected
        assert launch_with_pdl(cuda, False) is False
        if expected:
            assert launch_with_pdl(cuda, True) is True
        else:
            with pytest.raises(
                ValueError, match=r"pdl=True: .* needs sm90 or newer; cuda:0 is sm8"
            ):
                launch_with_pdl(cuda, True)
    # the CPU interpreter: the knob never turns it on, a test may
    cpu = torch.device("cpu")
    assert launch_with_pdl(cpu, None) is False and launch_with_pdl(cpu, True) is True


@pytest.mark.usefixtures("interpreted")
def test_each_launcher_hands_triton_its_decision(monkeypatch):
    """The real kernels run (interpreted); a spy on Triton's launch records launch_pdl."""
    from triton.runtime.interpreter import InterpretedFunction

    seen: list[bool] = []
    run = InterpretedFunction.run

    def spy(self, *args, **kwargs):
        seen.append(kwargs["launch_pdl"])
        return run(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", spy)
    monkeypatch.setenv(PDL.env, "1")  # still off on the CPU: the knob decides for CUDA cards
    x = torch.randn(2, 256).to(torch.bfloat16)
    codes = torch.randint(0, 16, (16, 256))
    tiles = w4a16.tiles_from_checkpoint(w4a16.pack_codes(codes), torch.ones(16, 2).bfloat16())
    q, k, v = (torch.randn(1, 2, 1, 16).bfloat16() for _ in range(3))
    state = torch.randn(3, 1, 16, 16)
    for pdl in (None, True, False):
        split_qkv.split_qkv(x, 64, 64, 128, pdl=pdl)
        ba_proj.ba_projection(x, torch.randn(4, 256).bfloat16(), pdl=pdl)
        w4a16.w4a16_matmul(x, *tiles, 128, w4a16.TileConfig(16, 128, 1), pdl=pdl)
        gdn_recurrent.gdn_recurrent_update(
            torch.zeros(1), torch.zeros(2, 1), torch.zeros(2, 1), torch.zeros(1), q, k, v, state,
            torch.tensor([0, 2], dtype=torch.int32), torch.tensor([[1, 2]], dtype=torch.int32),
            torch.tensor([1], dtype=torch.int32), pdl=pdl,
        )  # fmt: skip
    assert seen == [False] * 4 + [True] * 4 + [False] * 4


def test_compiled_kernels_wait_before_their_first_read_and_keep_the_old_code_without_pdl():
    """PTX compiled here for sm90 and sm120 with PDL on, sm86 and sm90 off (tests/pdl_ptx.py),
    in program order: weights prefetched before the wait, the wait before the first read of
    anything, dependents released after it; off, none of the three."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")])
    command = [sys.executable, str(ROOT / "tests" / "pdl_ptx.py"), "90:1", "120:1", "86:0", "90:0"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout)
    assert len(found) == 5 * 4
    for case, order in found.items():
        name, _, pdl = case.split("@")
        if pdl == "0":
            assert order == ["read", "store"], case
            continue
        weights = name.startswith(("w4a16", "ba_proj"))
        assert order[: 2 + weights] == ["prefetch"] * weights + ["wait", "read"], case
        assert "release" in order and "store" in order, case


@pytest.mark.usefixtures("interpreted")
def test_the_gpu_tests_chain_runs_the_same_with_pdl_on_the_interpreter():
    """bench/pdl_chain.py, which the GPU test and `hyperqwen bench pdl` replay, at the tiny
    geometry: every layer's x and state the same with the kernels' PDL code on and off."""
    from hyperqwen.bench.pdl_chain import Chain, make_weights, random_step
    from hyperqwen.checkpoint.geometry import PRESETS

    geometry = PRESETS["tiny"]
    weights = make_weights(geometry, layers=1, device="cpu")
    step = random_step(geometry, layers=1, tokens=2, seed=1, device="cpu")
    results = []
    for pdl in (False, True):
        chain = Chain(geometry, weights, tokens=2, pdl=pdl, device="cpu")
        chain.load(*step)
        chain.run()
        results.append([*chain.x, *chain.states])
    assert not results[0][-1].isnan().any() and not torch.equal(results[0][0], results[0][1])
    assert all(torch.equal(off, on) for off, on in zip(*results, strict=True))


def test_bench_pdl_refuses_without_an_sm90_gpu(tmp_path):
    done = hyperqwen("bench", "pdl", "--out", str(tmp_path / "pdl.json"), env={}, cwd=tmp_path)
    assert done.returncode == 3 and "needs a CUDA GPU of sm90 or newer" in done.stderr
    assert not (tmp_path / "pdl.json").exists()

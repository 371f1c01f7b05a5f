"""A tensor-parallel size the checkpoint cannot take is refused before vLLM (or a GPU) is touched
(hyperqwen/parallel.py); the split each mode gets is in test_launch.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from cli_runner import hyperqwen
from loaded_settings import loaded

from hyperqwen.launch import build_launch
from hyperqwen.parallel import tensor_parallel_problems, tensor_parallel_refusal, workable_sizes


@pytest.fixture(scope="module")
def config_27b(tmp_path_factory) -> dict:
    directory = tmp_path_factory.mktemp("synth") / "27b"
    command = [sys.executable, "-m", "hyperqwen.cli", "synth", str(directory), "--preset", "27b"]
    subprocess.run([*command, "--config-only"], check=True, capture_output=True, timeout=300)
    return directory


def test_the_27b_splits_over_1_2_4_8_gpus(config_27b):
    config = json.loads((config_27b / "config.json").read_text())
    assert workable_sizes(config) == [1, 2, 4, 8]
    assert tensor_parallel_problems(config, 3) == [
        "16 GDN key heads",
        "4 KV heads",
        "17408 MLP down inputs (quantized in groups of 128)",
    ]
    assert tensor_parallel_problems(config, 8) == []  # 4 KV heads replicated twice


def test_a_plain_attention_model_and_group_sizes():
    llama = {"num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536}
    assert workable_sizes(llama) == [1, 3]
    grouped = {
        **llama,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "quantization_config": {"config_groups": {"g": {"weights": {"group_size": 256}}}},
    }
    # 4 and 8 divide the heads, but 1536 / 4 = 384 inputs are not whole groups of 256
    assert workable_sizes(grouped) == [1, 2]


def test_serve_refuses_a_split_the_model_cannot_take(config_27b, tmp_path):
    env = {"MODEL": str(config_27b), "GPU_COUNT": "3", "HOME": str(tmp_path)}
    refused = hyperqwen("serve", "single", env=env, cwd=tmp_path)
    assert refused.returncode == 2
    assert "GPU_COUNT=3 with GPU_SPLIT=tp" in refused.stderr
    assert "GPU_COUNT values that work with tp: 1, 2, 4, 8; or set GPU_SPLIT=dp" in refused.stderr
    replicas = build_launch(loaded(GPU_COUNT="3"), "batch", None)  # dp: every GPU a replica
    config = json.loads((config_27b / "config.json").read_text())
    assert tensor_parallel_refusal(config, replicas.tensor_parallel, "m") is None

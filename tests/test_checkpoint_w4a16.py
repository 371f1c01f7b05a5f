"""The W4A16 pack-quantized format module: bit layout, round trip, config read and refusal."""

import json

import pytest
import torch

from hyperqwen.checkpoint import w4a16, w4a16_sizes

ALL_ZERO_NIBBLES = torch.tensor(0x88888888, dtype=torch.int64).to(torch.int32)  # 0 -> 8 (offset)


def test_packed_tensors_have_the_public_base_layout():
    stored = w4a16.pack(torch.randn(256, 512, dtype=torch.bfloat16) * 0.02)
    assert stored["weight_packed"].dtype == torch.int32
    assert stored["weight_packed"].shape == (256, 512 // 8)
    assert stored["weight_scale"].dtype == torch.bfloat16
    assert stored["weight_scale"].shape == (256, 512 // 128)
    assert stored["weight_shape"].dtype == torch.int64
    assert stored["weight_shape"].tolist() == [256, 512]
    expected = w4a16.stored_shapes(256, 512)
    for suffix, tensor in stored.items():
        assert (tuple(tensor.shape), tensor.dtype) == expected[suffix]


def test_the_torch_free_sizes_are_the_packed_tensors_bytes():
    # what the launcher counts without torch (capacity_probe) is what pack writes
    stored = w4a16.pack(torch.randn(256, 512, dtype=torch.bfloat16) * 0.02)
    group, bits = w4a16_sizes.GROUP_SIZE, w4a16_sizes.NUM_BITS
    assert (group, bits) == (w4a16.GROUP_SIZE, w4a16.NUM_BITS)
    assert stored["weight_packed"].nbytes == 256 * 512 * bits // 8
    assert stored["weight_scale"].nbytes == 256 * 512 // group * w4a16_sizes.SCALE_BYTES
    assert stored["weight_shape"].nbytes == w4a16_sizes.SHAPE_BYTES


def test_nibbles_are_offset_by_eight_and_packed_low_first():
    weight = torch.zeros(2, 128, dtype=torch.bfloat16)
    weight[1, 0] = 1.0  # the group maximum: quantizes to +7, stored as 15 in the lowest nibble
    # scale = 1.0 / 7.5 (0.1338 in bf16): -0.5 quantizes to -4, stored as 4 in the 2nd nibble
    # of the 2nd int32
    weight[1, 9] = -0.5
    packed = w4a16.pack(weight)["weight_packed"]
    assert torch.all(packed[0] == ALL_ZERO_NIBBLES)
    assert packed[1, 0].item() == torch.tensor(0x8888888F).to(torch.int32).item()
    assert packed[1, 1].item() == torch.tensor(0x88888848).to(torch.int32).item()
    assert torch.all(packed[1, 2:] == ALL_ZERO_NIBBLES)


def test_round_trip_error_is_within_half_a_quantization_step():
    weight = torch.randn(384, 1024, dtype=torch.bfloat16) * 0.02
    stored = w4a16.pack(weight)
    restored = w4a16.unpack(stored)
    step = stored["weight_scale"].float().repeat_interleave(w4a16.GROUP_SIZE, dim=1)
    # half a step, plus bf16 rounding of the scale and of scale * q
    assert ((restored.float() - weight.float()).abs() / step).max() <= 0.6
    assert w4a16.read_linear({f"m.{k}": v for k, v in stored.items()}, "m").equal(restored)
    assert w4a16.read_linear({"n.weight": weight}, "n").equal(weight)


def _write_config(directory, quantization_config):
    (directory / "config.json").write_text(json.dumps({"quantization_config": quantization_config}))


def test_read_quantization_config_accepts_what_was_written(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5"}))
    w4a16.write_quantization_config(tmp_path, ["lm_head"])
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == "qwen3_5"  # the rest of config.json is kept
    raw = written["quantization_config"]
    assert raw["format"] == "pack-quantized" and raw["quantization_status"] == "compressed"
    assert raw["config_groups"]["group_0"]["targets"] == ["Linear"]
    config = w4a16.read_quantization_config(tmp_path)
    assert config.ignore == ["lm_head"]


@pytest.mark.parametrize(
    ("field", "value"),
    [("format", "naive-quantized"), ("group_size", 64), ("num_bits", 8), ("symmetric", False)],
)
def test_read_quantization_config_refuses_other_formats(tmp_path, field, value):
    raw = w4a16.quantization_config(["lm_head"]).model_dump(mode="json")
    if field == "format":
        raw["format"] = value
    else:
        raw["config_groups"]["group_0"]["weights"][field] = value
    _write_config(tmp_path, raw)
    with pytest.raises(w4a16.FormatError, match="not compressed-tensors pack-quantized"):
        w4a16.read_quantization_config(tmp_path)


def test_read_quantization_config_refuses_unquantized_checkpoints(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(w4a16.FormatError, match="no quantization_config"):
        w4a16.read_quantization_config(tmp_path)


def test_kernel_shape_check_names_the_knob():
    w4a16.check_kernel_shape("x.weight", 256, 512, ("a", "b"))
    with pytest.raises(w4a16.FormatError, match=r"in_features=200 \(= hidden_size\)"):
        w4a16.check_kernel_shape("x.weight", 256, 200, ("intermediate_size", "hidden_size"))
    with pytest.raises(w4a16.FormatError, match=r"out_features=192 \(= intermediate_size\)"):
        w4a16.check_kernel_shape("x.weight", 192, 256, ("intermediate_size", "hidden_size"))

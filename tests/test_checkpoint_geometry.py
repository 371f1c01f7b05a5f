"""Geometry presets, `--set` overrides and the checks that keep a geometry servable by vLLM."""

import pytest

from hyperqwen.checkpoint import layout, w4a16
from hyperqwen.checkpoint.geometry import PRESETS, GeometryError
from hyperqwen.checkpoint.synthesize import check_geometry
from hyperqwen.checkpoint.tokenizer import TOKENIZER_SIZE


def test_27b_preset_is_the_real_model():
    g = PRESETS["27b"]
    assert (g.num_hidden_layers, g.hidden_size, g.intermediate_size) == (64, 5120, 17408)
    assert (g.num_attention_heads, g.num_key_value_heads, g.head_dim) == (24, 4, 256)
    assert (g.linear_num_key_heads, g.linear_num_value_heads) == (16, 48)
    assert (g.linear_key_head_dim, g.linear_value_head_dim, g.linear_conv_kernel_dim) == (
        128,
        128,
        4,
    )
    assert (g.vocab_size, g.partial_rotary_factor, g.rope_theta) == (248_320, 0.25, 1e7)
    assert g.mtp_num_hidden_layers == 1
    assert g.layer_types.count("linear_attention") == 48
    assert g.layer_types.count("full_attention") == 16
    assert g.mrope_section == [11, 11, 10]


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_repeat_three_gdn_then_one_attention(preset):
    types = PRESETS[preset].layer_types
    assert types[:4] == ["linear_attention"] * 3 + ["full_attention"]
    assert all(
        kind == ("full_attention" if index % 4 == 3 else "linear_attention")
        for index, kind in enumerate(types)
    )
    check_geometry(PRESETS[preset])


def test_27b_parameter_count_matches_a_27b_model():
    specs = layout.checkpoint_layout(PRESETS["27b"])
    body = sum(
        spec.shape[0] * spec.shape[1]
        for spec in specs
        if spec.name.startswith(layout.DECODER_PREFIX) and len(spec.shape) == 2
    )
    assert 25e9 < body < 28e9


def test_overrides_parse_by_field_type():
    g = PRESETS["tiny"].with_overrides(["hidden_size=512", "rope_theta=1e6", "num-hidden-layers=8"])
    assert (g.hidden_size, g.rope_theta, g.num_hidden_layers) == (512, 1e6, 8)
    assert isinstance(g.hidden_size, int) and isinstance(g.rope_theta, float)
    assert PRESETS["tiny"].hidden_size == 256  # presets are frozen, overrides copy


@pytest.mark.parametrize(
    ("assignment", "message"),
    [
        ("hidden=512", "KEY one of"),
        ("hidden_size", "KEY=VALUE"),
        ("hidden_size=big", "takes a int"),
    ],
)
def test_bad_overrides_name_the_valid_keys(assignment, message):
    with pytest.raises(GeometryError, match=message):
        PRESETS["tiny"].with_overrides([assignment])


@pytest.mark.parametrize(
    ("assignments", "message"),
    [
        (["num_key_value_heads=3"], "multiple of num_key_value_heads"),
        (["linear_num_value_heads=5"], "multiple of linear_num_key_heads"),
        (["vocab_size=1000"], "smaller than the tokenizer"),
        (["num_hidden_layers=3"], "no full-attention layer"),
        (["partial_rotary_factor=0.01"], "even number"),
        (["head_dim=0"], "head_dim=0 must be > 0"),
    ],
)
def test_invalid_geometry_is_refused_with_the_knob_named(assignments, message):
    with pytest.raises(GeometryError, match=message):
        PRESETS["tiny"].with_overrides(assignments).validate(TOKENIZER_SIZE)


@pytest.mark.parametrize(
    ("assignment", "knob"),
    [
        ("hidden_size=320", "hidden_size"),
        ("intermediate_size=600", "intermediate_size"),
        ("head_dim=96", "num_key_value_heads\\*head_dim"),
    ],
)
def test_shapes_the_int4_kernels_reject_are_refused(assignment, knob):
    geometry = PRESETS["tiny"].with_overrides([assignment])
    with pytest.raises(w4a16.FormatError, match=f"= {knob}\\)"):
        check_geometry(geometry)

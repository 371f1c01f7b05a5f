"""The one `vllm serve` flag reader (hyperqwen.vllm_flags): every spelling vLLM's parser takes.
test_launch.py checks the aliases and values against vLLM's own parser."""

from __future__ import annotations

import pytest

from hyperqwen.vllm_flags import (
    FlagToken,
    flag_keys,
    flag_name,
    flag_value,
    read_flag,
    speculates,
    value_positions,
)

SPEC = '{"method":"ngram","num_speculative_tokens":2}'


@pytest.mark.parametrize(
    ("token", "flag"),
    [
        ("--max-num-seqs", FlagToken("--max-num-seqs", False, None, False)),
        ("--max_num_seqs", FlagToken("--max-num-seqs", False, None, False)),
        ("--max_num_seqs=8", FlagToken("--max-num-seqs", False, None, True)),
        ("-tp", FlagToken("--tensor-parallel-size", False, None, False)),
        ("-sc=" + SPEC, FlagToken("--speculative-config", False, None, True)),
        ("-cc.mode=3", FlagToken("--compilation-config", False, "mode", True)),
        # `_` becomes `-` in the flag only, as vLLM does: a key keeps its spelling
        ("--speculative_config.num_speculative_tokens", FlagToken(
            "--speculative-config", False, "num_speculative_tokens", False)),
        ("--no-enable-prefix-caching", FlagToken("--enable-prefix-caching", True, None, False)),
        ("--no_enable_prefix_caching", FlagToken("--enable-prefix-caching", True, None, False)),
    ],
)  # fmt: skip
def test_each_spelling_vllm_takes_names_its_canonical_flag(token, flag) -> None:
    assert read_flag(token) == flag
    assert flag_name(token) == flag.name


@pytest.mark.parametrize("token", ["8", "-1", "-0.5", "-", SPEC, "model"])
def test_values_name_no_flag(token) -> None:
    assert read_flag(token) is None and flag_name(token) is None


def test_the_last_value_wins_whatever_its_spelling() -> None:
    argv = ["serve", "m", "--max-num-seqs", "4", "--enable-chunked-prefill", "--max_num_seqs=8"]
    assert flag_value(argv, "--max-num-seqs") == "8"
    assert flag_value(argv[:4], "--max-num-seqs") == "4"
    assert flag_value(argv, "--max-model-len") is None
    assert flag_value(["--max-num-seqs"], "--max-num-seqs") is None  # the value never came


def test_value_positions_keep_the_spelling_for_a_rewrite() -> None:
    argv = ["-sc", SPEC, f"--speculative_config={SPEC}", "--speculative-config.method", "mtp"]
    assert value_positions(argv, "--speculative-config") == [(1, ""), (2, "--speculative_config=")]
    assert value_positions(["-sc"], "--speculative-config") == [(1, "")]  # past the end
    assert flag_keys(argv, "--speculative-config") == ["--speculative-config.method"]


def test_no_flags_carry_no_value() -> None:
    argv = ["--no-enable-prefix-caching", "--max-num-seqs", "4"]
    assert value_positions(argv, "--enable-prefix-caching") == []
    assert flag_value(argv, "--enable-prefix-caching") is None


@pytest.mark.parametrize(
    ("argv", "speculating"),
    [
        (["serve", "m", "--speculative-config", SPEC], True),
        (["serve", "m", "--speculative_config", SPEC], True),
        (["serve", "m", f"--speculative_config={SPEC}"], True),
        (["serve", "m", "-sc", SPEC], True),
        (["serve", "m", "--speculative-config.method", "ngram"], True),
        (["serve", "m", "--max-num-seqs", "4"], False),
        (["serve", "m", "--served-model-name", "speculative-config"], False),
    ],
)
def test_speculates_in_any_spelling(argv, speculating) -> None:
    assert speculates(argv) is speculating

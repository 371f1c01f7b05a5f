"""`hyperqwen bench ab`: each side's vLLM argv (speculative config, the stock side's flags),
read by the real parser from the options of a comparison between a stock and a patched vllm/
tree of the pinned wheel."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_ab_plans import (
    NO_STOCK_SPEC_NOTE,
    RATES,
    SAME_SPEC_NOTE,
    parsed,
    sides_argv,
)
from cli_runner import run_in_process

from hyperqwen.bench.ab_argv import (
    baseline_note,
    profile_serve_argv,
    queue_notes,
    spec_config,
    spec_fields,
    with_synthetic_acceptance,
)
from hyperqwen.bench.ab_plan import ABError
from hyperqwen.checkpoint.geometry import PRESETS
from hyperqwen.checkpoint.synthesize import synthesize
from hyperqwen.vllm_flags import flag_value

# --- server argv -----------------------------------------------------------------------------


def test_synthetic_acceptance_lands_in_vllms_speculative_config(tmp_path) -> None:
    env_file = tmp_path / "empty.env"
    env_file.write_text("")
    argv = profile_serve_argv(tmp_path / "model", 8000, "single", str(env_file))
    assert argv[:2] == ["serve", str(tmp_path / "model")]
    patched = with_synthetic_acceptance(argv, (0.77, 0.55, 0.40))
    config = json.loads(patched[patched.index("--speculative-config") + 1])
    assert config["method"] == "mtp" and config["num_speculative_tokens"] == 3
    assert config["rejection_sample_method"] == "synthetic"
    assert config["synthetic_acceptance_rates"] == [0.77, 0.55, 0.40]

    inline = ['--speculative-config={"method":"ngram","num_speculative_tokens":2}']
    (done,) = with_synthetic_acceptance(inline, (0.5, 0.25))
    assert json.loads(done.removeprefix("--speculative-config="))["synthetic_acceptance_rates"] == [
        0.5,
        0.25,
    ]
    # vLLM's own rules: one rate per drafted token, non-increasing.
    with pytest.raises(Exception, match="must have length 3"):
        with_synthetic_acceptance(argv, (0.5, 0.4))
    with pytest.raises(Exception, match="non-increasing"):
        with_synthetic_acceptance(argv, (0.3, 0.5, 0.6))
    # rest: the rate of every position past the list (15 slots beside stock MTP's 3)
    wide = ['--speculative-config={"method":"mtp","num_speculative_tokens":15}']
    (done,) = with_synthetic_acceptance(wide, (0.77, 0.55, 0.40), 0.0)
    rates = json.loads(done.removeprefix("--speculative-config="))["synthetic_acceptance_rates"]
    assert rates == [0.77, 0.55, 0.40, *[0.0] * 12]
    (done,) = with_synthetic_acceptance(inline, (0.5, 0.25), 0.0)  # nothing past: unchanged
    assert json.loads(done.removeprefix("--speculative-config="))["synthetic_acceptance_rates"] == [
        0.5,
        0.25,
    ]
    with pytest.raises(Exception, match="must have length 15"):
        with_synthetic_acceptance(wide, (0.77, 0.55, 0.40))
    with pytest.raises(Exception, match="non-increasing"):
        with_synthetic_acceptance(wide, (0.77, 0.55, 0.40), 0.5)


SIZING_FLAGS = ("--max-model-len", "--max-num-seqs", "--max-num-batched-tokens")


def test_the_patched_side_is_sized_as_hyperqwen_serve_sizes_it(tmp_path, monkeypatch, capsys):
    """The 27B geometry (config only, dummy weights through --vllm-args) with CTX=huge and an
    fp8 cache in a fixed 5 GiB pool: 262,144 tokens do not fit it, and bench ab's patched argv
    takes the length `hyperqwen serve` would (vLLM refused the unsized argv on the GPU host);
    a length the pool cannot hold, set by hand, is refused naming its knob."""
    model = synthesize(tmp_path / "q27", PRESETS["27b"], config_only=True, progress=False)
    env_file = tmp_path / "empty.env"
    env_file.write_text("")
    for name, value in {"CTX": "huge", "KV": "fp8", "KV_MEM": "5G", "GPU_UTIL": "0.3"}.items():
        monkeypatch.setenv(name, value)
    dummy = "--load-format dummy --language-model-only"
    argv = profile_serve_argv(model.directory, 8000, "single", str(env_file), dummy)
    monkeypatch.setenv("EXTRA_ARGS", dummy)
    monkeypatch.setenv("MODEL", str(model.directory))
    monkeypatch.setenv("PRINT_ARGV", "1")
    capsys.readouterr()
    assert run_in_process("serve", "single", "--env-file", str(env_file)) == 0
    served = capsys.readouterr().out.splitlines()
    assert int(flag_value(argv, "--max-model-len")) < 262_144
    for flag in SIZING_FLAGS:
        assert flag_value(argv, flag) == flag_value(served, flag), flag

    monkeypatch.setenv("MAX_LEN", "262144")
    with pytest.raises(ABError, match="MAX_LEN"):
        profile_serve_argv(model.directory, 8000, "single", str(env_file), dummy)


def test_spec_fields_are_the_keys_vllms_speculative_config_takes() -> None:
    import dataclasses

    import vllm
    from vllm.config.speculative import SpeculativeConfig

    taken = {field.name for field in dataclasses.fields(SpeculativeConfig) if field.init}
    assert spec_fields(Path(vllm.__file__).parents[1]) == taken
    assert {"method", "num_speculative_tokens", "synthetic_acceptance_rates"} <= taken


@pytest.mark.parametrize("knobs", ["", "SPEC=mtp\nDRAFT_SAMPLE=probabilistic\n", "SPEC=ngram\n"])
def test_stock_side_speculates_as_the_patched_side_by_default(comparison, tmp_path, knobs) -> None:
    (tmp_path / "empty.env").write_text(knobs)
    single = [*comparison, "--mode", "single"]
    drafts = spec_config(sides_argv(parsed(single))["patched"])["num_speculative_tokens"]
    rates = ",".join(["0.77", "0.55", "0.40", "0.2"][:drafts])  # mtp drafts 3 tokens, ngram 4
    plan = parsed([*single, "--synthetic-acceptance", rates])
    assert plan.stock_spec == "same"
    commands = sides_argv(plan)
    # The stock tree (the pinned wheel's) takes every key of the profile's config as it is.
    stock, patched = spec_config(commands["stock"]), spec_config(commands["patched"])
    assert stock == patched and stock["method"] == ("ngram" if "ngram" in knobs else "mtp")
    assert stock["rejection_sample_method"] == "synthetic"
    assert stock["synthetic_acceptance_rates"] == [float(rate) for rate in rates.split(",")]
    assert commands["stock"][-4:] == ["--load-format", "dummy", "--max-model-len", "4096"]
    assert baseline_note(commands) == SAME_SPEC_NOTE


def test_stock_spec_none_and_stock_args(comparison, capsys) -> None:
    single = [*comparison, "--mode", "single", "--synthetic-acceptance", RATES]
    commands = sides_argv(parsed([*single, "--stock-spec", "none"]))
    assert "--speculative-config" not in commands["stock"]
    assert spec_config(commands["patched"])["synthetic_acceptance_rates"] == [0.77, 0.55, 0.40]
    assert baseline_note(commands) == NO_STOCK_SPEC_NOTE

    # --stock-args: last on the stock side, nowhere on the patched one.
    commands = sides_argv(parsed([*single, "--stock-args=--enforce-eager --max-num-seqs 4"]))
    assert commands["stock"][-3:] == ["--enforce-eager", "--max-num-seqs", "4"]
    assert "--enforce-eager" not in commands["patched"]
    # A --speculative-config of its own wins (vLLM keeps the last), rates and all.
    own = '--stock-args=--speculative-config \'{"method":"ngram","num_speculative_tokens":3}\''
    commands = sides_argv(parsed([*single, own]))
    stock = spec_config(commands["stock"])
    assert stock["method"] == "ngram" and stock["synthetic_acceptance_rates"] == [0.77, 0.55, 0.4]
    assert baseline_note(commands).startswith(
        'The stock side speculates with its own --speculative-config ({"method":"ngram",'
    )

    assert run_in_process("bench", *single, "--stock-args=--speculative-config {nope") == 2
    assert "--speculative-config '{nope' is not JSON" in capsys.readouterr().err
    assert run_in_process("bench", *single, "--stock-args=--seed '7") == 2
    error = capsys.readouterr().err
    assert "--stock-args" in error and "cannot be read: No closing quotation" in error


@pytest.mark.parametrize("spelling", ["--speculative_config ", "-sc ", "--speculative_config="])
def test_the_stock_sides_flags_count_in_every_spelling_vllm_takes(comparison, spelling) -> None:
    config = '{"method":"ngram","num_speculative_tokens":3}'
    single = [*comparison, "--mode", "single", "--stock-spec", "none"]
    single += [
        "--synthetic-acceptance",
        RATES,
        f"--stock-args={spelling}'{config}' --max_num_seqs 2",
    ]
    commands = sides_argv(parsed(single))
    stock = spec_config(commands["stock"])
    assert stock["method"] == "ngram" and stock["synthetic_acceptance_rates"] == [0.77, 0.55, 0.4]
    assert baseline_note(commands).startswith("The stock side speculates with its own")
    assert queue_notes([1, 4], commands) == [
        "The stock side serves at most 2 streams (--max-num-seqs 2): at C4 the other streams "
        "wait for a slot, so those rows' TTFT and total tok/s include the queue."
    ]


def test_one_key_of_the_speculative_config_alone_is_refused(comparison, capsys) -> None:
    single = [*comparison, "--mode", "single", "--stock-args=--speculative_config.method ngram"]
    assert run_in_process("bench", *single) == 2
    assert "--speculative_config.method: give the speculative config as one JSON value" in (
        capsys.readouterr().err
    )
    assert not (Path(comparison[comparison.index("--workdir") + 1])).exists()  # no server


def test_keys_the_stock_tree_lacks_are_left_out_and_noted(comparison, tmp_path) -> None:
    # A stock tree whose SpeculativeConfig predates draft_sample_method (as a key only the
    # patched vLLM knew would be): the stock side's config goes without it.
    older = tmp_path / "older-stock" / "vllm" / "config"
    older.mkdir(parents=True)
    fields = ("method", "num_speculative_tokens", "rejection_sample_method")
    body = "".join(f"    {name}: object = None\n" for name in fields)
    (older / "speculative.py").write_text(f"class SpeculativeConfig:\n{body}")
    single = [*comparison, "--mode", "single", "--stock-vllm", str(older.parents[1])]
    commands = sides_argv(parsed(single))
    assert spec_config(commands["stock"]) == {"method": "mtp", "num_speculative_tokens": 3}
    assert "draft_sample_method" in spec_config(commands["patched"])
    assert baseline_note(commands) == (
        f"{SAME_SPEC_NOTE} Left out of the stock side's: draft_sample_method (stock vLLM's "
        "SpeculativeConfig has no such field)."
    )

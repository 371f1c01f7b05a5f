"""Loading knobs: .env precedence, refusals with clear messages, key handling, generated docs."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_runner import ROOT, hyperqwen

from hyperqwen import docs
from hyperqwen.settings import Settings, SettingsError, knobs, load_settings, resolve_api_key


def test_environment_wins_over_env_file(tmp_path):
    env_file = tmp_path / ".env"
    env_file.write_text("PORT=9000\nMAX_SEQS=8\n# comment\nSPEC=ngram\nHOST=\n")
    loaded = load_settings({"PORT": "9100"}, env_file)
    assert loaded.settings.PORT == 9100 and loaded.sources["PORT"] == "environment"
    assert loaded.settings.MAX_SEQS == 8 and loaded.sources["MAX_SEQS"] == str(env_file)
    assert loaded.settings.SPEC == "ngram"
    assert loaded.settings.HOST is None and "HOST" not in loaded.explicit
    assert loaded.explicit == {"PORT", "MAX_SEQS", "SPEC"}


def test_env_file_from_env_file_variable(tmp_path):
    (tmp_path / "custom.env").write_text("CTX=long\n")
    loaded = load_settings({"ENV_FILE": str(tmp_path / "custom.env")})
    assert loaded.settings.CTX == "long"


def test_unknown_variables_are_ignored_and_defaults_hold():
    loaded = load_settings({"SOMETHING_ELSE": "1"}, Path("/nonexistent/.env"))
    assert loaded.settings == Settings() and loaded.explicit == frozenset()


@pytest.mark.parametrize(
    ("name", "value", "allowed"),
    [
        ("SPEC", "eagle", "mtp | ngram | lookup | off"),
        ("CTX", "medium", "fast | long | huge"),
        ("PORT", "70000", "integer >= 1, <= 65535"),
        ("GPU_UTIL", "1.5", "number > 0.05, <= 0.99"),
        (
            "KV",
            "nvfp4",
            "auto | fp8 | fp8_e4m3 | fp8_e5m2 | int8_per_token_head | fp8_per_token_head | "
            "int4_per_token_head | turboquant_k8v4 | turboquant_4bit_nc | turboquant_k3v4_nc | "
            "turboquant_3bit_nc | kvarn. Fix",
        ),
        ("KV_MEM", "6GiB", "bytes, e.g. 6G"),
        ("TOOLS", "true", "0 | 1"),
        # the public project's lookup knob read "true" as off; here it is refused
        ("LOOKUP", "true", "auto | 0 | 1"),
        ("LOOKUP", "on", "auto | 0 | 1"),
        ("LOOKUP_DEVICE", "cuda", "cpu | gpu"),
        ("LOOKUP_DEVICE", "gpu ", "cpu | gpu"),
        ("HOST", " ", "text"),
        # vLLM takes no fp8 GDN state (config/cache.py: MambaDType)
        ("STATE_DTYPE", "fp8", "auto | float32 | bfloat16 | float16"),
        ("STATE_DTYPE", "bf16", "auto | float32 | bfloat16 | float16"),
        # KVarN's value bits: 2 or 3 (kvarn/layout.py stores no other)
        ("KVARN_V_BITS", "4", "2 | 3"),
        ("KVARN_V_BITS", "abc", "2 | 3"),
    ],
)
def test_refusal_names_knob_value_and_allowed(name, value, allowed):
    with pytest.raises(SettingsError) as error:
        load_settings({name: value}, Path("/nonexistent"))
    message = str(error.value)
    assert message.startswith(f"{name}={value!r} is not valid")
    assert f"Allowed: {allowed}" in message


def test_secret_value_never_in_refusal(monkeypatch):
    # A key cannot be invalid today, but the redaction path must hold for any secret knob.
    from hyperqwen import settings as module

    class Strict(Settings):
        VLLM_API_KEY: int | None = Settings.model_fields["VLLM_API_KEY"]  # type: ignore

    monkeypatch.setattr(module, "Settings", Strict)
    with pytest.raises(SettingsError) as error:
        load_settings({"VLLM_API_KEY": "s3cr3t-value"}, Path("/nonexistent"))
    assert "s3cr3t" not in str(error.value) and "(hidden)" in str(error.value)


def test_api_key_file_fallback(tmp_path):
    key_file = tmp_path / "api_key.txt"
    key_file.write_text("  from-file \nsecond line\n")
    settings = Settings(API_KEY_FILE=key_file)
    assert resolve_api_key(settings) == ("from-file", str(key_file))
    assert resolve_api_key(Settings(API_KEY_FILE=key_file, VLLM_API_KEY="env")) == (
        "env",
        "VLLM_API_KEY",
    )
    assert resolve_api_key(Settings(API_KEY_FILE=tmp_path / "missing")) == (None, "unset")
    key_file.write_text("\n")
    assert resolve_api_key(settings) == (None, "unset")


def test_cli_refuses_bad_knob_with_exit_2(tmp_path):
    result = hyperqwen("serve", "single", env={"SPEC": "eagle", "MAX_SEQS": "-1"}, cwd=tmp_path)
    assert result.returncode == 2
    assert "refusing to start" in result.stderr
    assert "SPEC='eagle'" in result.stderr and "MAX_SEQS='-1'" in result.stderr
    assert result.stdout == ""


def test_print_argv_needs_no_gpu_and_one_arg_per_line(tmp_path):
    result = hyperqwen("serve", "batch", env={"PRINT_ARGV": "1", "MAX_SEQS": "16"}, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[:3] == ["vllm", "serve", "models/Qwen3.8-27B-W4A16-hq"]
    assert lines[lines.index("--max-num-seqs") + 1] == "16"
    flag_only = hyperqwen("serve", "batch", "--print-argv", env={"MAX_SEQS": "16"}, cwd=tmp_path)
    assert flag_only.stdout == result.stdout


def test_serve_without_gpu_stops_early_and_never_prints_the_key(tmp_path):
    (tmp_path / ".env").write_text("VLLM_API_KEY=hunter2-secret\nSPEC=ngram\n")
    result = hyperqwen("serve", "single", env={}, cwd=tmp_path)
    assert result.returncode == 3
    assert "no CUDA GPU" in result.stderr and "compute capability 8.0" in result.stderr
    assert "PRINT_ARGV=1" in result.stderr
    assert "VLLM_API_KEY: set (14 chars)" in result.stderr
    assert "SPEC=ngram  (.env)" in result.stderr
    assert "hunter2" not in result.stderr + result.stdout


def test_shadow_and_mode_warnings_reach_the_user(tmp_path):
    result = hyperqwen(
        "serve",
        "batch",
        "--print-argv",
        env={"SPEC": "mtp", "EXTRA_ARGS": "--max-model-len 4096"},
        cwd=tmp_path,
    )
    assert result.returncode == 0
    assert "WARNING: SPEC is a single-mode knob; ignored in batch mode." in result.stderr
    assert "WARNING: EXTRA_ARGS sets --max-model-len" in result.stderr
    assert result.stdout.splitlines()[-2:] == ["--max-model-len", "4096"]


def test_every_knob_has_help_and_becomes():
    for info in knobs():
        assert info.help.endswith(".") and len(info.help) > 20, info.name
        assert info.becomes and info.modes, info.name


def test_env_example_is_generated_from_settings():
    assert (ROOT / ".env.example").read_text() == docs.env_example(), (
        "regenerate: hyperqwen settings --write-docs ."
    )


@pytest.mark.parametrize(("mode", "readme"), [("single", "single-user"), ("batch", "batch")])
def test_knob_tables_in_readmes_are_generated(mode, readme):
    text = (ROOT / readme / "README.md").read_text()
    start, end = text.index(docs.TABLE_BEGIN), text.index(docs.TABLE_END) + len(docs.TABLE_END)
    assert text[start:end] + "\n" == docs.knob_table(mode), (
        "regenerate: hyperqwen settings --write-docs ."
    )


def test_compose_knob_list_is_generated():
    text = (ROOT / docs.COMPOSE_FILE).read_text()
    start = text.index(docs.COMPOSE_BEGIN)
    end = text.index(docs.COMPOSE_END) + len(docs.COMPOSE_END)
    assert text[start:end] + "\n" == docs.compose_knobs(), (
        "regenerate: hyperqwen settings --write-docs ."
    )


def test_env_example_round_trips_through_load_settings(tmp_path):
    # Uncommenting every line of the template must give valid settings equal to the defaults.
    lines = [
        line[2:]
        for line in docs.env_example().splitlines()
        if line.startswith("# ") and "=" in line.split()[1] and line[2:3].isupper()
    ]
    (tmp_path / ".env").write_text("\n".join(lines) + "\n")
    assert load_settings({}, tmp_path / ".env").settings == Settings()

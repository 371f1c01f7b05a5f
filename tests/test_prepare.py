"""`hyperqwen prepare` on a synthetic base: the files it writes, what it reports, re-runs, options,
undoing steps, the lock, and the refusals before any write."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import process_group
import pytest
import torch
from compressed_tensors.quantization import QuantizationConfig
from test_prepare_common import (
    GEOMETRY,
    MEASURE_SCRIPT,
    ROOT,
    SEED,
    copy_base,
    own_copy,
    prepare_process,
    run_prepare,
    tiny_base_dir,
    tree_digest,
)

from hyperqwen.checkpoint import layout, shards, w4a16
from hyperqwen.checkpoint.synthesize import initial_value, synthesize
from hyperqwen.checkpoint.tokenizer import SPECIAL_TOKEN_IDS
from hyperqwen.doctor import PREPARED_MARKER
from hyperqwen.drafter.vocab import DEFAULT_RANKING, cut, read_ranking
from hyperqwen.prepare import folder
from hyperqwen.prepare.tensors import MTP_TARGET
from hyperqwen.synth import prepared_quantization_edit

EMBED = "model.language_model.embed_tokens"
MTP_LINEARS = [
    spec.module
    for spec in layout.checkpoint_layout(GEOMETRY)
    if spec.kind is layout.Kind.LINEAR and spec.name.startswith("mtp.")
]
ALL_STEPS_SKIPPED = [
    arg
    for step in ("lm_head", "embed", "mtp", "draft_vocab", "chat_template")
    for arg in ("--skip", step)
]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return tiny_base_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def prepared_run(base, tmp_path_factory):
    """A default prepare of a copy of the base: (folder, exit code, stdout)."""
    target = copy_base(base, tmp_path_factory.mktemp("prepared") / "model")
    code, out, err = run_prepare(str(target), "--quiet")
    assert code == 0, err
    return target, out


@pytest.fixture(scope="module")
def prepared(prepared_run) -> Path:
    return prepared_run[0]


def _base_weight(name: str) -> torch.Tensor:
    spec = next(spec for spec in layout.checkpoint_layout(GEOMETRY) if spec.name == name)
    return initial_value(spec, SEED)


def _stored(reader, module: str) -> dict[str, torch.Tensor]:
    return {suffix: reader[f"{module}.{suffix}"] for suffix in w4a16.PACKED_SUFFIXES}


# --- a full prepare ------------------------------------------------------------------------


def test_reports_every_step_with_its_error_and_the_total_time(prepared_run):
    _, out = prepared_run
    for title in ("lm_head -> int8", "embed_tokens -> int8", "MTP linears -> int8"):
        line = next(line for line in out.splitlines() if title in line)
        assert re.search(r"done: bits 8, group size 128, .*relative error 0\.\d+%", line), line
    assert re.search(r"draft vocabulary \(40960 ids\).*done: size 40960", out)
    assert re.search(r"chat template hardening\s+done: .*array arguments hardened", out)
    assert re.search(r"prepared .*: 5 step\(s\) done now, total [\d.]+ s", out)


def test_config_quantizes_head_embedding_and_mtp_int8_and_stops_ignoring_them(prepared):
    config = json.loads((prepared / "config.json").read_text())
    raw = config["quantization_config"]
    groups = raw["config_groups"]
    assert groups["group_0"]["weights"]["num_bits"] == 4
    assert groups["hyperqwen_lm_head"]["targets"] == ["re:.*lm_head$"]
    assert groups["hyperqwen_embed_tokens"]["targets"] == ["re:.*embed_tokens$"]
    assert groups["hyperqwen_mtp"]["targets"] == [MTP_TARGET]
    for name in ("hyperqwen_lm_head", "hyperqwen_embed_tokens", "hyperqwen_mtp"):
        weights = groups[name]["weights"]
        assert (weights["num_bits"], weights["group_size"], weights["symmetric"]) == (8, 128, True)
        assert weights["strategy"] == "group" and weights["type"] == "int"
    assert not {"lm_head", EMBED, *MTP_LINEARS} & set(raw["ignore"])
    assert "model.language_model.layers.0.linear_attn.in_proj_a" in raw["ignore"]
    assert all(w4a16.matches(MTP_TARGET, module) for module in MTP_LINEARS)
    QuantizationConfig.model_validate(raw)
    w4a16.read_quantization_config(prepared)  # the format module accepts the new groups
    base_config = json.loads((prepared / folder.PRISTINE_DIR / "config.json").read_text())
    assert {**config, "quantization_config": None} == {
        **base_config,
        "quantization_config": None,
    }


def test_tensors_are_int8_packed_and_round_trip_within_the_recorded_error(prepared, base):
    reader = shards.ShardedReader(prepared)
    record = json.loads((prepared / PREPARED_MARKER).read_text())["steps"]
    for module, step in (("lm_head", "lm_head"), (EMBED, "embed"), ("mtp.fc", "mtp")):
        stored = _stored(reader, module)
        original = _base_weight(f"{module}.weight")
        out_features, in_features = original.shape
        assert stored["weight_packed"].shape == (out_features, in_features // 4)
        assert stored["weight_scale"].shape == (out_features, in_features // 128)
        assert stored["weight_shape"].tolist() == [out_features, in_features]
        assert f"{module}.weight" not in reader
        restored = w4a16.unpack(stored).double()
        error = float((restored - original.double()).norm() / original.double().norm())
        recorded = (
            record[step]
            .get("per_module_relative_error", {})
            .get(module, record[step]["relative_error"])
        )
        assert error == pytest.approx(recorded, abs=2e-6)
        assert 0.005 < error < 0.01
    # the body is untouched: same int4 bytes as the base
    body = "model.language_model.layers.0.mlp.down_proj.weight_packed"
    assert torch.equal(reader[body], shards.ShardedReader(base)[body])


def test_only_shards_with_changed_tensors_are_rewritten_and_the_base_ones_are_kept(prepared, base):
    live = sorted(path.name for path in prepared.glob("model-*.safetensors"))
    assert live == sorted(set(shards.ShardedReader(prepared).shard_files()))
    untouched = [name for name in live if ".hq-" not in name]
    assert untouched and all((prepared / name).samefile(base / name) for name in untouched)
    retired = sorted(path.name for path in (prepared / folder.PRISTINE_DIR).glob("*.safetensors"))
    rewritten = [name for name in live if ".hq-" in name]
    assert retired == sorted(name.split(".hq-")[0] + ".safetensors" for name in rewritten)
    for name in retired:  # moved, not copied: the very file of the base
        assert (prepared / folder.PRISTINE_DIR / name).samefile(base / name)
    index = json.loads((prepared / shards.INDEX_NAME).read_text())
    total = sum(
        entry.nbytes
        for shard in set(index["weight_map"].values())
        for entry in shards.read_header(prepared / shard).tensors.values()
    )
    assert index["metadata"]["total_size"] == total


def test_draft_vocabulary_is_special_tokens_plus_the_ranking_and_the_head_is_lm_head_rows(prepared):
    lines = (prepared / folder.DRAFT_IDS_FILE).read_text().splitlines()
    ids = [int(line) for line in lines if not line.startswith("#")]
    assert len(ids) == 40_960 and ids == sorted(ids)
    assert set(SPECIAL_TOKEN_IDS.values()) <= set(ids)
    assert ids == cut(read_ranking(DEFAULT_RANKING), 40_960, GEOMETRY.vocab_size)
    from safetensors.torch import load_file

    head = load_file(prepared / folder.DRAFT_HEAD_FILE)
    reader = shards.ShardedReader(prepared)
    chosen = torch.tensor(ids)
    assert torch.equal(head["draft_head.token_ids"], chosen)
    assert torch.equal(head["draft_head.weight_packed"], reader["lm_head.weight_packed"][chosen])
    assert torch.equal(head["draft_head.weight_scale"], reader["lm_head.weight_scale"][chosen])
    assert head["draft_head.weight_shape"].tolist() == [40_960, GEOMETRY.hidden_size]
    assert (prepared / folder.DRAFT_RANKING_FILE).read_bytes() == DEFAULT_RANKING.read_bytes()


def test_marker_records_steps_options_and_the_committed_index(prepared):
    record = json.loads((prepared / PREPARED_MARKER).read_text())
    assert list(record["steps"]) == ["lm_head", "embed", "mtp", "draft_vocab", "chat_template"]
    assert record["options"]["mtp_bits"] == 8 and record["options"]["skip"] == []
    assert record["steps"]["mtp"]["modules"] == len(MTP_LINEARS)
    assert all(record["steps"][step]["relative_error"] < 0.01 for step in ("lm_head", "embed"))
    index_bytes = (prepared / shards.INDEX_NAME).read_bytes()
    import hashlib

    assert record["index_sha256"] == hashlib.sha256(index_bytes).hexdigest()


def test_pristine_copies_of_replaced_files_are_the_base(prepared, base):
    for name in ("config.json", shards.INDEX_NAME, "chat_template.jinja"):
        assert (prepared / folder.PRISTINE_DIR / name).read_bytes() == (base / name).read_bytes()
        assert (prepared / name).read_bytes() != (base / name).read_bytes()


# --- re-runs and options -------------------------------------------------------------------


# Run first in prepare's interpreter: on exit, print the modules it loaded and the files it
# opened (Python's audit events) as the last line.
REPORT_WHAT_WAS_TOUCHED = """
import atexit, json, sys
opened = []
sys.addaudithook(lambda event, args: event == "open" and opened.append(str(args[0])))
atexit.register(lambda: print(json.dumps({"modules": sorted(sys.modules), "opened": opened})))
"""


def test_a_prepared_folder_is_recognized_without_loading_a_tensor_library(prepared):
    """What keeps the re-run well under a second (compose runs prepare on every `up`): torch,
    safetensors and transformers stay unloaded and no tensor file is opened. Counted, not
    timed, so a loaded machine cannot fail it."""
    before = tree_digest(prepared)
    done = prepare_process(str(prepared), prelude=REPORT_WHAT_WAS_TOUCHED)
    assert done.returncode == 0, done.stderr
    assert "already prepared" in done.stdout
    touched = json.loads(done.stdout.splitlines()[-1])
    assert not {"torch", "safetensors", "transformers"} & set(touched["modules"])
    in_folder = [path for path in touched["opened"] if Path(path).is_relative_to(prepared)]
    assert PREPARED_MARKER in {Path(path).name for path in in_folder}  # the hook saw reads
    assert not [path for path in in_folder if path.endswith(".safetensors")]
    assert tree_digest(prepared) == before


def test_status_lists_each_step_with_its_error(prepared, tmp_path):
    code, out, _ = run_prepare(str(prepared), "--status")
    assert code == 0
    assert re.search(r"lm_head -> int8 group-128\s+done: .*relative error 0\.\d+%", out)
    assert re.search(r"chat template hardening\s+done", out)
    code, out, _ = run_prepare(str(tmp_path / "nothing"), "--status")
    assert code == 0 and "not prepared" in out


def test_mtp_bits_4_persists_and_going_back_gives_the_same_bytes(prepared, base, tmp_path):
    model = copy_base(base, tmp_path / "model")
    code, _, err = run_prepare(str(model), "--quiet", "--mtp-bits", "4")
    assert code == 0, err
    config = json.loads((model / "config.json").read_text())["quantization_config"]
    assert config["config_groups"]["hyperqwen_mtp"]["weights"]["num_bits"] == 4
    reader = shards.ShardedReader(model)
    assert reader["mtp.fc.weight_packed"].shape == (
        GEOMETRY.hidden_size,
        2 * GEOMETRY.hidden_size // 8,
    )
    code, out, _ = run_prepare(str(model))  # the option persists: nothing to do
    assert code == 0 and "already prepared" in out
    code, _, err = run_prepare(str(model), "--quiet", "--mtp-bits", "8")
    assert code == 0, err
    assert tree_digest(model) == tree_digest(prepared)


def test_skipping_every_step_restores_the_base_files(prepared, base, tmp_path):
    model = copy_base(prepared, tmp_path / "model")
    code, out, err = run_prepare(str(model), "--quiet", *ALL_STEPS_SKIPPED)
    assert code == 0, err
    assert out.count("skipped") == 5
    visible = {
        name: digest
        for name, digest in tree_digest(model).items()
        if not name.startswith(folder.WORK_DIR) and name != PREPARED_MARKER
    }
    assert visible == tree_digest(base)
    code, _, err = run_prepare(str(model), "--quiet", "--skip", "none")
    assert code == 0, err
    assert tree_digest(model) == tree_digest(prepared)


def test_a_second_prepare_is_refused_while_the_first_holds_the_lock(base, tmp_path):
    model = copy_base(base, tmp_path / "model")
    with folder.exclusive_lock(model):
        done = prepare_process(str(model))
    assert done.returncode == 2
    assert "another `hyperqwen prepare` is working on" in done.stderr
    assert not (model / PREPARED_MARKER).exists()


# What prepare loads before touching a tensor: the floor its peak memory is measured above.
IMPORTS_ONLY = (
    "import torch, transformers, safetensors.torch, compressed_tensors, "
    "hyperqwen.prepare.run, hyperqwen.prepare.cli"
)


def test_peak_memory_stays_under_twice_the_largest_tensor_plus_a_gib(base, tmp_path):
    """Streaming: tensors are copied and quantized a block of rows at a time. (The 4.5 B
    parameter measurement is in prepare/README.md; here the bound is checked on the tiny base,
    where the interpreter with torch and transformers, ~0.9 GB, is most of it.)"""
    model = copy_base(base, tmp_path / "model")
    largest = max(
        entry.nbytes
        for shard in set(shards.ShardedReader(base).shard_files())
        for entry in shards.read_header(base / shard).tensors.values()
    )
    done = prepare_process(str(model), "--quiet", measure_memory=True)
    assert done.returncode == 0, done.stderr
    peak = int(done.stdout.split()[-1]) * 1024
    # The interpreter with torch, transformers and safetensors loaded is the floor; what
    # prepare adds on top of it is what streaming bounds.
    floor = process_group.run(
        [sys.executable, "-c", MEASURE_SCRIPT, IMPORTS_ONLY], capture_output=True, text=True,
        env={"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT / "src")}, timeout=300,
        check=True,
    )  # fmt: skip
    imports = int(floor.stdout.split()[-1]) * 1024
    assert peak - imports <= 2 * largest + 256 * 2**20, (peak, imports, largest)


def test_the_error_bound_is_enforced_before_anything_is_committed(base, tmp_path):
    model = copy_base(base, tmp_path / "model")
    code, _, err = run_prepare(str(model), "--quiet", "--max-error", "0.5")
    assert code == 2
    assert re.search(r"int8 round-trip error 0\.\d+% exceeds the bound 0\.500%", err)
    assert (model / "config.json").read_bytes() == (base / "config.json").read_bytes()
    assert (model / shards.INDEX_NAME).read_bytes() == (base / shards.INDEX_NAME).read_bytes()
    assert not list(model.glob("*.hq-*")) and not list(model.glob(".*.tmp"))


# --- refusals before any write -------------------------------------------------------------


def _edit_config(model: Path, edit) -> None:
    path = own_copy(model / "config.json")
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("damage", "complaint"),
    [
        (
            lambda m: _edit_config(m, lambda c: c.pop("quantization_config")),
            r"config\.json has no quantization_config.*compressed-tensors W4A16",
        ),
        (
            lambda m: _edit_config(
                m, lambda c: c["quantization_config"].update(format="naive-quantized")
            ),
            r"not compressed-tensors pack-quantized W4A16",
        ),
        (
            lambda m: _edit_config(m, lambda c: c.update(model_type="llama")),
            r"model_type 'llama'; prepare knows the Qwen3\.5 architecture only",
        ),
        (
            lambda m: _edit_config(
                m, lambda c: c["text_config"].update(layer_types=["full_attention"] * 4)
            ),
            r"layer_types .* an unexpected layer layout",
        ),
        (
            lambda m: _edit_config(
                m,
                lambda c: c["text_config"].update(
                    num_hidden_layers=8, layer_types=c["text_config"]["layer_types"] * 2
                ),
            ),
            r"do not match the Qwen3\.5 W4A16 base layout.*layers\.4\..* is missing",
        ),
        (
            lambda m: (m / "tokenizer.json").unlink(),
            r"tokenizer file\(s\) missing: tokenizer\.json",
        ),
        (
            lambda m: os.truncate(own_copy(m / "model-00002-of-00004.safetensors"), 1_000_000),
            r"model-00002-of-00004\.safetensors: the header describes \d+ bytes but the file "
            r"has 1000000: truncated.*Download or copy model-00002-of-00004\.safetensors again",
        ),
        (
            lambda m: (m / "model-00003-of-00004.safetensors").unlink(),
            r"model-00003-of-00004\.safetensors is missing \(the index lists it\); put the "
            r"base checkpoint's files",
        ),
    ],
    ids=[
        "not-quantized",
        "other-format",
        "other-architecture",
        "layer-types",
        "missing-layers",
        "no-tokenizer",
        "truncated-shard",
        "missing-shard",
    ],
)
def test_bad_inputs_are_refused_before_any_write(base, tmp_path, damage, complaint):
    model = copy_base(base, tmp_path / "model")
    damage(model)
    before = tree_digest(model)
    code, _, err = run_prepare(str(model), "--quiet")
    assert code == 2
    assert re.search(complaint, err, re.DOTALL), err
    assert str(model) in err
    assert tree_digest(model) == before
    assert not (model / folder.WORK_DIR).exists()


def test_regex_ignore_entries_naming_a_target_are_expanded_to_what_else_they_named(base, tmp_path):
    model = copy_base(base, tmp_path / "model")

    def regex_ignores(config):
        raw = config["quantization_config"]
        raw["ignore"] = [
            entry for entry in raw["ignore"] if not entry.startswith("mtp.") and entry != "lm_head"
        ] + [r"re:^mtp\..*", "re:.*lm_head"]

    _edit_config(model, regex_ignores)
    code, _, err = run_prepare(str(model), "--quiet")
    assert code == 0, err
    ignore = json.loads((model / "config.json").read_text())["quantization_config"]["ignore"]
    assert not any(
        w4a16.matches(entry, module) for entry in ignore for module in [*MTP_LINEARS, "lm_head"]
    )
    assert r"re:^mtp\..*" not in ignore and "re:.*lm_head" not in ignore
    assert "mtp.layers.0.input_layernorm" in ignore  # what else the regex named stays ignored
    assert "model.language_model.layers.0.linear_attn.in_proj_b" in ignore


def test_synth_prepared_config_is_the_config_prepare_writes(prepared, tmp_path):
    """`synth --config-only --prepared` (speed runs with dummy weights) must describe exactly
    the checkpoint prepare makes, or its measurements would be of another model."""
    config_only = synthesize(
        tmp_path / "config-only",
        GEOMETRY,
        config_only=True,
        progress=False,
        edit_quantization=prepared_quantization_edit(GEOMETRY),
    ).directory
    written = json.loads((config_only / "config.json").read_text())
    assert written == json.loads((prepared / "config.json").read_text())
    plain = synthesize(tmp_path / "plain", GEOMETRY, config_only=True, progress=False).directory
    assert json.loads((plain / "config.json").read_text()) != written


@pytest.mark.parametrize("spec", ["mtp", "off"])
@pytest.mark.parametrize("which", ["base", "prepared"])
def test_a_dummy_load_is_sized_as_the_shards_it_stands_in_for(which, spec, request):
    # `--load-format dummy` reads no shard: the launcher counts what config.json declares
    # (capacity_probe.py), which must be what a real folder of that config holds
    from hyperqwen.capacity_probe import declared_weight_bytes, loaded_weight_bytes
    from hyperqwen.settings import Settings

    model = request.getfixturevalue(which)
    settings = Settings(SPEC=spec)
    config = json.loads((model / "config.json").read_text())
    declared = declared_weight_bytes(config, GEOMETRY, settings)
    features = loaded_weight_bytes(model, settings, shards=False)
    assert declared > 0 and (features > 0) == (which == "prepared" and spec == "mtp")
    assert declared + features == loaded_weight_bytes(model, settings)
    if features:
        # the draft head's int8 rows as the engine holds them, bf16, and its int64 ids
        lines = (model / folder.DRAFT_IDS_FILE).read_text().splitlines()
        rows = sum(not line.startswith("#") for line in lines)
        assert features == rows * (GEOMETRY.hidden_size * 2 + 8)

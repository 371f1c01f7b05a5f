"""`hyperqwen synth` end to end: the CLI, then the files read back by compressed-tensors'
decompressor, transformers, and vLLM 0.26.0's own config path, model classes and weight loader.

vLLM runs on its CPU platform here. The CUDA wheel has no CPU kernels (`vllm._C`), and one of
them, `_C::silu_and_mul`, is looked up when the MLP is constructed; its schema is registered
so the real model classes can be built. No forward pass runs, so no kernel is ever called.
"""

import argparse
import contextlib
import io
import json
import os
import re
import shutil

import pytest
import torch
from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import (
    CompressedTensorsDequantizer,
)
from transformers import AutoConfig, AutoTokenizer

from hyperqwen.checkpoint import layout, shards, w4a16
from hyperqwen.checkpoint.geometry import PRESETS
from hyperqwen.checkpoint.synthesize import initial_value
from hyperqwen.synth import add_subcommand

SEED = 7


def run_cli(*argv: str) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="hyperqwen")
    add_subcommand(parser.add_subparsers())
    args = parser.parse_args(["synth", *argv])
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = args.func(args)
    return code, stdout.getvalue(), stderr.getvalue()


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    directory = tmp_path_factory.mktemp("synth") / "tiny"
    code, out, _ = run_cli(
        str(directory), "--preset", "tiny", "--max-shard-size", "100MB", "--seed", str(SEED)
    )
    assert code == 0
    return directory, out


@pytest.fixture(scope="module")
def tiny(tiny_run):
    return tiny_run[0]


@pytest.fixture(scope="module")
def shape_27b(tmp_path_factory):
    directory = tmp_path_factory.mktemp("synth") / "27b"
    code, out, _ = run_cli(str(directory), "--preset", "27b", "--config-only")
    assert code == 0 and "config + tokenizer only" in out
    return directory


def stored_tensor_shapes(specs):
    """Name -> (shape, dtype) of every tensor the files must hold for this layout."""
    expected = {}
    for spec in specs:
        if spec.quantized:
            for suffix, shape_dtype in w4a16.stored_shapes(*spec.shape).items():
                expected[w4a16.packed_name(spec.module, suffix)] = shape_dtype
        else:
            expected[spec.name] = (spec.shape, torch.bfloat16)
    return expected


# --- the CLI and the files -------------------------------------------------------------


def test_help_teaches_presets_keys_and_serving(capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_cli("--help")
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert re.search(r"hidden_size\s+256\s+5120", text)
    assert re.search(r"num_hidden_layers\s+4\s+64", text)
    assert "--load-format dummy" in text and "--language-model-only" in text


def test_cli_reports_what_it_wrote(tiny_run):
    directory, out = tiny_run
    assert f"wrote {directory}" in out
    for name in ("config.json", "tokenizer.json", shards.INDEX_NAME, "model-00001-of-00004"):
        assert name in out
    assert re.search(r"total [\d.]+ MB in [\d.]+ s", out)


def test_files_hold_exactly_the_layout_in_size_limited_shards(tiny):
    specs = layout.checkpoint_layout(PRESETS["tiny"])
    expected = stored_tensor_shapes(specs)
    reader = shards.ShardedReader(tiny)
    # embedding and lm_head (127 MB each) exceed 100 MB and get shards of their own
    assert reader.shard_files() == [shards.shard_name(i, 4) for i in range(4)]
    assert sorted(path.name for path in tiny.glob("*.safetensors")) == reader.shard_files()
    assert set(reader) == set(expected)
    total = 0
    for name, (shape, dtype) in expected.items():
        tensor = reader[name]
        assert (tuple(tensor.shape), tensor.dtype) == (shape, dtype), name
        total += tensor.numel() * tensor.element_size()
    index = json.loads((tiny / shards.INDEX_NAME).read_text())
    assert index["metadata"]["total_size"] == total
    for shard in reader.shard_files():
        tensors_in_shard = [name for name, file in index["weight_map"].items() if file == shard]
        assert (tiny / shard).stat().st_size <= 100e6 or len(tensors_in_shard) == 1
        assert (tiny / shard).stat().st_mode & 0o777 == 0o644


def test_weights_come_from_the_seed(tiny):
    reader = shards.ShardedReader(tiny)
    lm_head = next(
        s for s in layout.checkpoint_layout(PRESETS["tiny"]) if s.name == "lm_head.weight"
    )
    assert torch.equal(reader["lm_head.weight"], initial_value(lm_head, SEED))
    assert not torch.equal(reader["lm_head.weight"], initial_value(lm_head, SEED + 1))
    assert 0.018 < reader["lm_head.weight"].float().std().item() < 0.022


def test_compressed_tensors_decompressor_restores_the_original_weights(tiny):
    reader = shards.ShardedReader(tiny)
    tensors = {name: reader[name] for name in reader}
    dequantizer = CompressedTensorsDequantizer(tiny)
    dequantizer.validate(tensors)  # every targeted module has exactly its packed parameters
    restored = dequantizer.process(dict(tensors))
    specs = layout.checkpoint_layout(PRESETS["tiny"])
    quantized = [spec for spec in specs if spec.quantized]
    assert len(quantized) == 4 * 3 + 3 * 3 + 1 * 4  # MLPs, GDN qkv/z/out, attention q/k/v/o
    for spec in specs:
        original = initial_value(spec, SEED)
        if not spec.quantized:
            assert torch.equal(restored[spec.name], original), spec.name
            continue
        step = tensors[w4a16.packed_name(spec.module, "weight_scale")].float()
        step = step.repeat_interleave(w4a16.GROUP_SIZE, dim=1)
        error = (restored[spec.name].float() - original.float()).abs() / step
        assert error.max() <= 0.6, spec.name
        assert torch.equal(restored[spec.name], w4a16.read_linear(tensors, spec.module))


def test_transformers_loads_config_and_tokenizer(tiny):
    config = AutoConfig.from_pretrained(tiny)
    assert type(config).__name__ == "Qwen3_5Config"
    text = config.text_config
    assert type(text).__name__ == "Qwen3_5TextConfig"
    assert text.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert (text.hidden_size, text.vocab_size, text.mtp_num_hidden_layers) == (256, 248_320, 1)
    assert text.rope_parameters["partial_rotary_factor"] == 0.25
    assert config.vision_config.out_hidden_size == 256
    assert config.quantization_config["format"] == "pack-quantized"
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    assert tokenizer.encode("Hello, world!") == [9419, 11, 1814, 0]


def test_27b_config_only_has_the_real_geometry_and_no_weights(shape_27b):
    assert sorted(path.name for path in shape_27b.iterdir()) == [
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    config = json.loads((shape_27b / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert config["model_type"] == "qwen3_5" and "vision_config" in config
    text = config["text_config"]
    assert text["model_type"] == "qwen3_5_text"
    expected = {
        "num_hidden_layers": 64,
        "hidden_size": 5120,
        "intermediate_size": 17408,
        "num_attention_heads": 24,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 48,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "vocab_size": 248_320,
        "mtp_num_hidden_layers": 1,
        "tie_word_embeddings": False,
    }
    assert {key: text[key] for key in expected} == expected
    assert text["rope_parameters"] == {
        "rope_type": "default",
        "rope_theta": 10_000_000,
        "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
    }
    assert (
        text["layer_types"]
        == ["linear_attention"] * 3 + ["full_attention"] + text["layer_types"][4:]
    )
    assert text["layer_types"].count("full_attention") == 16
    ignore = config["quantization_config"]["ignore"]
    assert {"lm_head", "model.language_model.embed_tokens", "mtp.fc"} <= set(ignore)
    assert "model.language_model.layers.63.linear_attn.in_proj_a" not in ignore  # layer 63: attn
    assert "model.language_model.layers.62.linear_attn.in_proj_a" in ignore
    generation = json.loads((shape_27b / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [248_046, 248_044]


def test_cli_refuses_to_overwrite_unless_forced(shape_27b):
    before = (shape_27b / "config.json").read_text()
    code, _, err = run_cli(str(shape_27b), "--preset", "tiny", "--config-only")
    assert code == 2 and "--force" in err
    assert (shape_27b / "config.json").read_text() == before


def test_cli_rejects_a_bad_shard_size(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_cli(str(tmp_path / "x"), "--max-shard-size", "2 bananas")
    assert exit_info.value.code == 2
    assert "expected a number with a unit such as 500MB" in capsys.readouterr().err


def test_cli_reports_bad_overrides(tmp_path):
    code, _, err = run_cli(str(tmp_path / "x"), "--set", "hidden_size=320")
    assert code == 2 and "hidden_size" in err and "multiple of 128" in err
    assert not (tmp_path / "x").exists()


# --- vLLM 0.26.0 reads the checkpoint ---------------------------------------------------


@pytest.fixture(scope="module")
def vllm_cpu(tiny, vllm_cpu_platform):
    """vLLM on its CPU platform with a one-process gloo 'cluster' for the model classes."""
    if not hasattr(torch.ops._C, "silu_and_mul"):
        library = torch.library.Library("_C", "FRAGMENT")
        library.define("silu_and_mul(Tensor! result, Tensor input) -> ()")
    from vllm.config import set_current_vllm_config
    from vllm.distributed import destroy_distributed_environment, destroy_model_parallel

    from hyperqwen.bench.kernels import start_one_rank

    with set_current_vllm_config(engine_config(tiny)):
        start_one_rank()
    yield
    destroy_model_parallel()
    destroy_distributed_environment()


def engine_config(model_dir, **overrides):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=str(model_dir),
        language_model_only=True,
        max_model_len=2048,
        model_loader_extra_config={"enable_weights_track": True},
        **overrides,
    ).create_engine_config()


def build_model(vllm_config, model_config, device):
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    with (
        set_current_vllm_config(vllm_config),
        set_default_torch_dtype(model_config.dtype),
        torch.device(device),
    ):
        return initialize_model(vllm_config=vllm_config, model_config=model_config)


def test_vllm_config_path_accepts_the_checkpoint(vllm_cpu, tiny):
    vllm_config = engine_config(
        tiny, speculative_config={"method": "mtp", "num_speculative_tokens": 1}
    )
    model_config = vllm_config.model_config
    assert model_config.architectures == ["Qwen3_5ForConditionalGeneration"]
    assert model_config.quantization == "compressed-tensors"
    assert model_config.dtype == torch.bfloat16
    assert model_config.get_vocab_size() == 248_320
    assert vllm_config.cache_config.mamba_ssm_cache_dtype == "float32"
    assert vllm_config.speculative_config.draft_model_config.architectures == ["Qwen3_5MTP"]


def test_vllm_loads_every_weight_of_the_model_and_its_mtp_head(vllm_cpu, tiny):
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    vllm_config = engine_config(
        tiny, speculative_config={"method": "mtp", "num_speculative_tokens": 1}
    )
    loader = DefaultModelLoader(vllm_config.load_config)
    draft_config = vllm_config.speculative_config.draft_model_config
    with set_current_vllm_config(vllm_config):
        # enable_weights_track: vLLM raises if any parameter was not loaded from the files,
        # and its loaders raise on any tensor name or shape they do not expect.
        model = build_model(vllm_config, vllm_config.model_config, "cpu")
        loader.load_weights(model, vllm_config.model_config)
        draft = build_model(vllm_config, draft_config, "cpu")
        loader.load_weights(draft, draft_config)

    parameters = dict(model.named_parameters())
    gdn = "language_model.model.layers.0.linear_attn"
    assert parameters[f"{gdn}.in_proj_qkvz.weight_packed"].dtype == torch.int32  # quantized
    assert parameters[f"{gdn}.in_proj_ba.weight"].dtype == torch.bfloat16  # kept bf16
    reader = shards.ShardedReader(tiny)
    fused = torch.cat(
        [
            reader[f"model.language_model.layers.0.linear_attn.{name}.weight_packed"]
            for name in ("in_proj_qkv", "in_proj_z")
        ]
    )
    assert torch.equal(parameters[f"{gdn}.in_proj_qkvz.weight_packed"].data, fused)
    draft_parameters = dict(draft.named_parameters())
    assert "model.layers.0.self_attn.qkv_proj.weight" in draft_parameters  # MTP stays bf16
    assert torch.equal(draft_parameters["model.fc.weight"].data, reader["mtp.fc.weight"])


@contextlib.contextmanager
def mtp_drafter_with_draft_head(tiny, tmp_path, seed: int):
    """vLLM's Qwen3_5MTP of a copy of the tiny checkpoint that has a synthetic draft head (MTP
    k=2), weights loaded, in a proposer stand-in as the proposer_loaded seam gets it; inside
    vLLM's config. Yields (model folder, drafter, proposer)."""
    from types import SimpleNamespace

    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    from hyperqwen.synth import write_synthetic_draft_head

    model_dir = tmp_path / "tiny-with-head"
    shutil.copytree(tiny, model_dir, copy_function=os.link)
    write_synthetic_draft_head(model_dir, PRESETS["tiny"], seed=seed)
    vllm_config = engine_config(
        model_dir, speculative_config={"method": "mtp", "num_speculative_tokens": 2}
    )
    draft_config = vllm_config.speculative_config.draft_model_config
    with set_current_vllm_config(vllm_config):
        draft = build_model(vllm_config, draft_config, "cpu")
        DefaultModelLoader(vllm_config.load_config).load_weights(draft, draft_config)
        proposer = SimpleNamespace(
            model=draft, vllm_config=vllm_config, use_local_argmax_reduction=False
        )
        yield model_dir, draft, proposer


def test_draft_vocabulary_installs_into_vllms_own_mtp_drafter(
    vllm_cpu, tiny, tmp_path, monkeypatch
):
    """The real Qwen3_5MTP on vLLM's CPU platform, weights loaded, then the proposer_loaded seam
    (install()) with DRAFT_VOCAB off and auto: greedy drafts through LocalArgmaxMixin and
    sampled-draft logits come from the draft rows alone."""
    from hyperqwen.engine import draft_vocab, seams
    from hyperqwen.engine.features import DRAFT_VOCAB
    from hyperqwen.prepare.folder import DRAFT_HEAD_FILE

    with mtp_drafter_with_draft_head(tiny, tmp_path, seed=1) as (model_dir, draft, proposer):
        full_head = draft.lm_head
        monkeypatch.setenv(DRAFT_VOCAB.env, "off")
        seams.proposer_loaded(proposer)  # the seam both runners call
        assert draft.lm_head is full_head and not proposer.use_local_argmax_reduction
        monkeypatch.setenv(DRAFT_VOCAB.env, "auto")
        seams.proposer_loaded(proposer)
        assert draft.lm_head is not full_head and proposer.use_local_argmax_reduction
        hidden = torch.randn((5, PRESETS["tiny"].hidden_size), dtype=torch.bfloat16)
        greedy = draft.get_top_tokens(hidden)
        logits = draft.compute_logits(hidden)

    head = draft_vocab.load_draft_head(
        model_dir / DRAFT_HEAD_FILE, 248_320, PRESETS["tiny"].hidden_size, torch.bfloat16
    )
    assert proposer.use_local_argmax_reduction and draft.lm_head is not full_head
    reference = hidden.float() @ head.weight.float().T  # over the draft rows only
    rows = torch.searchsorted(head.token_ids, greedy)
    assert torch.equal(head.token_ids[rows], greedy)  # every greedy draft is a draft id
    chosen = reference.gather(1, rows[:, None]).squeeze(1)
    assert (chosen >= reference.max(dim=-1).values - 1e-2).all()  # the best row, up to bf16
    assert logits.shape == (5, 248_320)
    assert torch.equal(logits.argmax(dim=-1), greedy)
    outside = torch.ones(248_320, dtype=torch.bool)
    outside[head.token_ids] = False
    assert torch.isneginf(logits[:, outside]).all() and torch.isfinite(logits[:, ~outside]).all()


@pytest.mark.usefixtures("interpreted")
def test_int8_draft_head_drafts_what_the_bf16_rows_draft(vllm_cpu, tiny, tmp_path, monkeypatch):
    """The real Qwen3_5MTP, weights loaded, then the proposer_loaded seam with the draft
    vocabulary and DRAFT_HEAD_INT8=1: greedy drafts come from the fused int8 kernel (under
    Triton's interpreter here) and are the ids LocalArgmaxMixin picked from the bf16 rows,
    except where two rows tie to bf16 rounding; with greedy drafts the bf16 rows are freed."""
    from hyperqwen.engine import draft_head_int8, draft_vocab, seams
    from hyperqwen.engine.features import DRAFT_HEAD_INT8, DRAFT_VOCAB
    from hyperqwen.prepare.folder import DRAFT_HEAD_FILE

    hidden = torch.randn((6, PRESETS["tiny"].hidden_size), dtype=torch.bfloat16)
    with mtp_drafter_with_draft_head(tiny, tmp_path, seed=2) as (model_dir, draft, proposer):
        assert proposer.vllm_config.speculative_config.draft_sample_method == "greedy"
        monkeypatch.setenv(DRAFT_VOCAB.env, "auto")
        monkeypatch.setenv(DRAFT_HEAD_INT8.env, "0")
        seams.proposer_loaded(proposer)  # the draft vocabulary alone: vLLM's bf16 path
        bf16 = draft.get_top_tokens(hidden)
        assert draft_head_int8.install(proposer)  # as the seam calls it with the knob at 1
        fused = draft.get_top_tokens(hidden)
        with pytest.raises(RuntimeError, match="freed the drafter's bf16 rows"):
            draft.compute_logits(hidden)

    assert draft.lm_head.weight.numel() == 0  # greedy drafts: the bf16 rows are gone
    head = draft_vocab.load_draft_head(
        model_dir / DRAFT_HEAD_FILE, 248_320, PRESETS["tiny"].hidden_size, torch.float32
    )
    assert proposer.use_local_argmax_reduction and fused.dtype == torch.int64
    reference = hidden.double() @ head.weight.double().T
    rows = torch.searchsorted(head.token_ids, fused)
    assert torch.equal(head.token_ids[rows], fused)  # every draft is a draft id
    chosen = reference.gather(1, rows[:, None]).squeeze(1)
    assert (chosen >= reference.max(dim=-1).values - 1e-3).all()
    bf16_rows = torch.searchsorted(head.token_ids, bf16)
    bf16_chosen = reference.gather(1, bf16_rows[:, None]).squeeze(1)
    # the same draft, or a row the bf16 logits could not tell from it
    assert ((fused == bf16) | ((chosen - bf16_chosen).abs() < 1e-2)).all()


def _zero_stride_weights(specs, corrupt=None):
    """The layout's tensors as zero-stride views: full shapes, no memory."""
    for name, (shape, dtype) in stored_tensor_shapes(specs).items():
        if name == corrupt:
            shape = (shape[0] + 128, *shape[1:])
        yield name, torch.zeros((), dtype=dtype).expand(shape)


def test_27b_layout_is_what_vllm_builds_for_the_27b_config(vllm_cpu, shape_27b):
    """Every 27b tensor name and shape goes through vLLM's loader into a meta-device model."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    vllm_config = engine_config(shape_27b, load_format="dummy")
    specs = layout.checkpoint_layout(PRESETS["27b"])
    with set_current_vllm_config(vllm_config):
        model = build_model(vllm_config, vllm_config.model_config, "meta")
        loaded = model.load_weights(_zero_stride_weights(specs))
        DefaultModelLoader(vllm_config.load_config).track_weights_loading(model, loaded)
        corrupt = "model.language_model.layers.0.mlp.down_proj.weight_packed"
        with pytest.raises(AssertionError):  # vLLM's parameter loader checks every shape
            model.load_weights(_zero_stride_weights(specs, corrupt=corrupt))


@pytest.mark.parametrize("flag", ["--prepared", "--draft-head"])
def test_prepared_and_draft_head_need_config_only(tmp_path, flag):
    code, _, err = run_cli(str(tmp_path / "m"), flag)
    assert code == 2 and f"{flag} needs --config-only" in err and "hyperqwen prepare" in err
    assert not (tmp_path / "m").exists()


def test_draft_head_is_what_the_draft_vocabulary_loads(tmp_path):
    from hyperqwen.drafter.vocab import DEFAULT_DRAFT_SIZE, DEFAULT_RANKING, cut, read_ranking
    from hyperqwen.engine.draft_vocab import load_draft_head
    from hyperqwen.prepare.folder import DRAFT_HEAD_FILE

    geometry = PRESETS["tiny"]
    code, out, err = run_cli(str(tmp_path / "m"), "--config-only", "--draft-head")
    assert code == 0, err
    assert "synthetic draft head" in out and DRAFT_HEAD_FILE in out
    head = load_draft_head(
        tmp_path / "m" / DRAFT_HEAD_FILE, geometry.vocab_size, geometry.hidden_size, torch.bfloat16
    )
    expected = cut(read_ranking(DEFAULT_RANKING), DEFAULT_DRAFT_SIZE, geometry.vocab_size)
    assert head.token_ids.tolist() == expected
    assert head.weight.shape == (DEFAULT_DRAFT_SIZE, geometry.hidden_size)
    assert 0.015 < head.weight.float().std().item() < 0.025  # random rows, not zeros
    assert not list((tmp_path / "m").glob(".*.tmp"))  # written through a temporary, renamed

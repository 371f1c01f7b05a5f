"""A prepared checkpoint in vLLM 0.26.0, on its CPU platform: with the embed-quant patch it builds
and loads (main model and MTP draft), every int8 module is served by vLLM's own quantized
methods, the embedding lookup returns the stored int8 rows (vLLM's Triton gather kernel, run by
Triton's interpreter), the int8 lm_head scores like the bf16 one, and the MTP proposer shares
the quantized embedding. Stock vLLM 0.26.0 cannot load it: the patch is needed.

Each tree runs in its own interpreter (this file run as a script), which imports vLLM from that
tree. Machete and Marlin, vLLM's int8 linear kernels, are CUDA-only; the driver registers a CPU
reference kernel (dequantize, then `F.linear`) through vLLM's public `register_linear_kernel`,
which vLLM picks only where its own CPU kernel cannot (int8). The GPU run with the real kernels
is tests/test_prepare_gpu.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import process_group
import pytest
from test_prepare_common import prepare_copy, tiny_base_dir
from vllm_trees import copy_vllm_tree

ROOT = Path(__file__).resolve().parents[1]
PATCH = ROOT / "patches" / "embed-quant.patch"
TOKEN_IDS = [0, 11, 9419, 151_643, 248_044, 248_319]


# --- runs in the subprocess ----------------------------------------------------------------


def _reference_kernel():
    import torch
    import torch.nn.functional as F
    from vllm.model_executor.kernels.linear import register_linear_kernel
    from vllm.model_executor.kernels.linear.mixed_precision.MPLinearKernel import MPLinearKernel
    from vllm.platforms import PlatformEnum
    from vllm.scalar_type import scalar_types

    from hyperqwen.checkpoint import w4a16

    class CpuReferenceInt8(MPLinearKernel):
        @classmethod
        def get_min_capability(cls) -> int:
            return 0

        @classmethod
        def can_implement(cls, c):
            ok = c.weight_type == scalar_types.uint8b128 and not c.zero_points and not c.has_g_idx
            return ok, None if ok else "int8 symmetric only"

        def process_weights_after_loading(self, layer) -> None:
            pass

        def apply_weights(self, layer, x, bias=None):
            packed = getattr(layer, self.w_q_name)
            shape = torch.tensor([packed.shape[0], packed.shape[1] * 4])
            weight = w4a16.unpack(
                {
                    "weight_packed": packed,
                    "weight_scale": getattr(layer, self.w_s_name),
                    "weight_shape": shape,
                }
            )
            return F.linear(x, weight.to(x.dtype), bias)

    register_linear_kernel(CpuReferenceInt8, PlatformEnum.CPU)


def _stored_rows(checkpoint: Path, ids):
    """The embedding rows the files hold, dequantized in fp32 and rounded once to bf16 (what
    vLLM's gather kernel computes)."""
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    from hyperqwen.checkpoint import shards

    reader = shards.ShardedReader(checkpoint)
    prefix = "model.language_model.embed_tokens"
    shape = reader[f"{prefix}.weight_shape"]
    values = unpack_from_int32(reader[f"{prefix}.weight_packed"], 8, shape)[ids]
    scale = reader[f"{prefix}.weight_scale"][ids].float().repeat_interleave(128, dim=1)
    return (values.float() * scale).to(torch.bfloat16)


def _drive(vllm_parent: str, checkpoint: str, base: str) -> dict:
    sys.path.insert(0, vllm_parent)
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform

    platforms._current_platform = CpuPlatform()
    import torch
    import vllm

    report: dict = {"vllm_file": vllm.__file__}
    if not hasattr(torch.ops._C, "silu_and_mul"):  # looked up when an MLP is built
        library = torch.library.Library("_C", "FRAGMENT")  # kept alive: it owns the schema
        library.define("silu_and_mul(Tensor! result, Tensor input) -> ()")
    _reference_kernel()
    sys.path.insert(0, str(ROOT / "tests"))
    from test_synth import build_model, engine_config

    from hyperqwen.checkpoint import shards

    vllm_config = engine_config(
        checkpoint, speculative_config={"method": "mtp", "num_speculative_tokens": 1}
    )
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    with set_current_vllm_config(vllm_config):
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, distributed_init_method="tcp://127.0.0.1:0",
            backend="gloo",
        )  # fmt: skip
        initialize_model_parallel(1, 1)
        loader = DefaultModelLoader(vllm_config.load_config)
        draft_config = vllm_config.speculative_config.draft_model_config
        try:
            model = build_model(vllm_config, vllm_config.model_config, "cpu")
            loader.load_weights(model, vllm_config.model_config)
            draft = build_model(vllm_config, draft_config, "cpu")
            loader.load_weights(draft, draft_config)
        except Exception as error:
            import traceback

            report["load_error"] = f"{type(error).__name__}: {error}"
            report["load_traceback"] = traceback.format_exc()[-3000:]
            return report
        language = model.language_model
        methods = {
            "embed": language.model.embed_tokens.quant_method,
            "lm_head": language.lm_head.quant_method,
            "draft_embed": draft.model.embed_tokens.quant_method,
            "draft_lm_head": draft.lm_head.quant_method,
            "draft_qkv": draft.model.layers[0].self_attn.qkv_proj.quant_method,
            "draft_fc": draft.model.fc.quant_method,
            "body_gate_up": language.model.layers[0].mlp.gate_up_proj.quant_method,
        }
        report["methods"] = {name: type(method).__name__ for name, method in methods.items()}
        report["bits"] = {
            name: getattr(getattr(layer, "scheme", None), "num_bits", None)
            for name, layer in {
                "lm_head": language.lm_head,
                "draft_qkv": draft.model.layers[0].self_attn.qkv_proj,
                "body_gate_up": language.model.layers[0].mlp.gate_up_proj,
            }.items()
        }
        report["embed_bits"] = methods["embed"].num_bits

        ids = torch.tensor(TOKEN_IDS)
        looked_up = language.model.embed_input_ids(ids)
        expected = _stored_rows(Path(checkpoint), ids).float()
        # Within one bf16 step of the stored value: Triton's CPU interpreter may truncate
        # where a GPU rounds when it converts the fp32 product to bf16.
        step = torch.ldexp(torch.ones_like(expected), torch.frexp(expected).exponent - 8)
        report["embedding_ulps_from_files"] = float(
            ((looked_up.float() - expected).abs() / step).max()
        )
        original = shards.ShardedReader(Path(base))["model.language_model.embed_tokens.weight"]
        original = original[ids].float()
        report["embedding_relative_error"] = float(
            (looked_up.float() - original).norm() / original.norm()
        )

        hidden = torch.randn(4, looked_up.shape[-1], generator=torch.Generator().manual_seed(0))
        hidden = hidden.to(torch.bfloat16)
        logits = model.compute_logits(hidden).float()
        original = shards.ShardedReader(Path(base))["lm_head.weight"].float()
        reference = hidden.float() @ original.T
        report["logits_relative_error"] = float((logits - reference).norm() / reference.norm())

        from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

        class Proposer:  # the attribute _maybe_share_embeddings reads
            model = draft

        SpecDecodeBaseProposer._maybe_share_embeddings(Proposer(), language)
        report["mtp_shares_embedding"] = draft.model.embed_tokens is language.model.embed_tokens
    return report


if __name__ == "__main__" and len(sys.argv) == 5:
    result = _drive(*sys.argv[1:4])
    Path(sys.argv[4]).write_text(json.dumps(result))
    sys.exit(0)


# --- pytest --------------------------------------------------------------------------------


def _start_driver(vllm_parent: Path, checkpoint: Path, base: Path, report: Path):
    """The driver in a process group of its own, killed on leaving the context unless done."""
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT / "src"),
        # vLLM then keeps the real Triton (no GPU driver) and Triton interprets kernels on CPU.
        "CUDA_VISIBLE_DEVICES": "",
        "TRITON_INTERPRET": "1",
    }
    return process_group.started(
        [sys.executable, __file__, str(vllm_parent), str(checkpoint), str(base), str(report)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=report.parent,
    )


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory) -> Path:
    return tiny_base_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tiny_base) -> Path:
    return prepare_copy(tiny_base, tmp_path_factory.mktemp("vllm") / "prepared")


@pytest.fixture(scope="module")
def patched_parent(pristine_vllm_dir, tmp_path_factory) -> Path:
    """A pristine vLLM tree with only the embed-quant patch applied (the real `patch` tool)."""
    parent = tmp_path_factory.mktemp("embed-quant-vllm")
    copy_vllm_tree(pristine_vllm_dir, parent / "vllm")
    subprocess.run(
        ["patch", "-p1", "-F0", "--forward", "--batch", "-i", str(PATCH)],
        cwd=parent / "vllm",
        check=True,
        capture_output=True,
        timeout=120,
    )
    return parent


@pytest.fixture(scope="module")
def reports(patched_parent, pristine_vllm_dir, prepared, tiny_base, tmp_path_factory) -> dict:
    """Both trees' drivers, run side by side (one core each)."""
    folder = tmp_path_factory.mktemp("vllm-reports")
    trees = {"patched": patched_parent, "stock": pristine_vllm_dir.parent}
    results = {}
    with contextlib.ExitStack() as drivers:
        running = {
            name: drivers.enter_context(
                _start_driver(parent, prepared, tiny_base, folder / f"{name}.json")
            )
            for name, parent in trees.items()
        }
        for name, process in running.items():
            _, stderr = process.communicate(timeout=600)
            assert process.returncode == 0, stderr[-4000:]
            results[name] = json.loads((folder / f"{name}.json").read_text())
            assert results[name]["vllm_file"].startswith(str(trees[name]))
    return results


def test_patched_vllm_serves_the_prepared_checkpoint_quantized(reports):
    report = reports["patched"]
    assert "load_error" not in report, report.get("load_traceback")
    methods = report["methods"]
    assert methods["embed"] == methods["draft_embed"] == "CompressedTensorsEmbeddingWNA16Int"
    for name in ("lm_head", "draft_lm_head", "draft_qkv", "draft_fc", "body_gate_up"):
        assert methods[name] == "CompressedTensorsLinearMethod", name
    assert report["bits"] == {"lm_head": 8, "draft_qkv": 8, "body_gate_up": 4}
    assert report["embed_bits"] == 8
    assert report["embedding_ulps_from_files"] <= 1.0
    assert 0 < report["embedding_relative_error"] < 0.01
    assert report["logits_relative_error"] < 0.01
    assert report["mtp_shares_embedding"] is True


def test_stock_vllm_cannot_load_a_prepared_embedding(reports):
    assert "embed_tokens.weight_packed" in reports["stock"]["load_error"]

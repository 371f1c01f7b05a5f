"""Every tensor of a Qwen3.5 text checkpoint, named as the public W4A16 base names it.

Names follow the Hugging Face `Qwen3_5ForConditionalGeneration` layout that vLLM 0.26.0's
`qwen3_5` loader reads: `model.language_model.*` for the decoder (its `hf_to_vllm_mapper` turns
that prefix into `language_model.model.*` and stacks q/k/v, gate/up, qkv/z and b/a into fused
modules), `lm_head.weight`, and `mtp.*` for the multi-token-prediction head that the
`Qwen3_5MTP` draft model loads from the same files. Norms are Gemma-style (`x * (1 + w)`), so
their neutral value is zero; the Gated DeltaNet output norm multiplies by `w`, so it is one.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from hyperqwen.checkpoint.geometry import Geometry

DECODER_PREFIX = "model.language_model"
MTP_PREFIX = "mtp"
VISION_PREFIX = "model.visual"
# Blocks of the Qwen3.5 vision tower. Its weights are not synthesized (serve with
# --language-model-only), but vLLM still constructs its linears, so they must be in `ignore`.
VISION_DEPTH = 27


class Init(enum.Enum):
    """How a synthetic tensor is filled (the values a freshly initialised model would hold)."""

    NORMAL = "normal"
    ZEROS = "zeros"
    ONES = "ones"
    A_LOG = "a_log"


class Kind(enum.Enum):
    LINEAR = "linear"
    EMBEDDING = "embedding"
    OTHER = "other"


@dataclass(frozen=True)
class WeightSpec:
    """One full-precision tensor of the model, before any quantization."""

    name: str
    shape: tuple[int, ...]
    init: Init
    kind: Kind = Kind.OTHER
    quantized: bool = False
    # Which geometry knobs set (out_features, in_features): quoted by shape errors.
    dims_from: tuple[str, str] | None = None

    @property
    def module(self) -> str:
        return self.name.rpartition(".")[0]


def _linear(
    name: str,
    out_features: int,
    in_features: int,
    quantized: bool,
    dims_from: tuple[str, str] | None = None,
) -> WeightSpec:
    return WeightSpec(
        f"{name}.weight",
        (out_features, in_features),
        Init.NORMAL,
        Kind.LINEAR,
        quantized,
        dims_from,
    )


def _norm(name: str, size: int, init: Init = Init.ZEROS) -> WeightSpec:
    return WeightSpec(f"{name}.weight", (size,), init)


def _full_attention(g: Geometry, prefix: str, quantized: bool) -> list[WeightSpec]:
    hidden = g.hidden_size
    heads_dim = g.num_attention_heads * g.head_dim
    kv_dim = g.num_key_value_heads * g.head_dim
    return [
        # The query projection also emits the per-head output gate (attn_output_gate), hence 2x.
        _linear(
            f"{prefix}.q_proj",
            2 * heads_dim,
            hidden,
            quantized,
            ("2*num_attention_heads*head_dim", "hidden_size"),
        ),
        _linear(
            f"{prefix}.k_proj",
            kv_dim,
            hidden,
            quantized,
            ("num_key_value_heads*head_dim", "hidden_size"),
        ),
        _linear(
            f"{prefix}.v_proj",
            kv_dim,
            hidden,
            quantized,
            ("num_key_value_heads*head_dim", "hidden_size"),
        ),
        _linear(
            f"{prefix}.o_proj",
            hidden,
            heads_dim,
            quantized,
            ("hidden_size", "num_attention_heads*head_dim"),
        ),
        _norm(f"{prefix}.q_norm", g.head_dim),
        _norm(f"{prefix}.k_norm", g.head_dim),
    ]


def _linear_attention(g: Geometry, prefix: str) -> list[WeightSpec]:
    hidden = g.hidden_size
    value_heads = g.linear_num_value_heads
    conv_dim = 2 * g.linear_key_dim + g.linear_value_dim
    return [
        _linear(
            f"{prefix}.in_proj_qkv",
            conv_dim,
            hidden,
            True,
            (
                "2*linear_num_key_heads*linear_key_head_dim"
                "+linear_num_value_heads*linear_value_head_dim",
                "hidden_size",
            ),
        ),
        _linear(
            f"{prefix}.in_proj_z",
            g.linear_value_dim,
            hidden,
            True,
            ("linear_num_value_heads*linear_value_head_dim", "hidden_size"),
        ),
        # b and a have one output per value head (48 on the real model): too narrow for the
        # W4A16 kernels, so the public base keeps them bf16.
        _linear(f"{prefix}.in_proj_b", value_heads, hidden, False),
        _linear(f"{prefix}.in_proj_a", value_heads, hidden, False),
        WeightSpec(f"{prefix}.conv1d.weight", (conv_dim, 1, g.linear_conv_kernel_dim), Init.NORMAL),
        WeightSpec(f"{prefix}.dt_bias", (value_heads,), Init.ONES),
        WeightSpec(f"{prefix}.A_log", (value_heads,), Init.A_LOG),
        _norm(f"{prefix}.norm", g.linear_value_head_dim, Init.ONES),
        _linear(
            f"{prefix}.out_proj",
            hidden,
            g.linear_value_dim,
            True,
            ("hidden_size", "linear_num_value_heads*linear_value_head_dim"),
        ),
    ]


def _mlp(g: Geometry, prefix: str, quantized: bool) -> list[WeightSpec]:
    up_dims = ("intermediate_size", "hidden_size")
    down_dims = ("hidden_size", "intermediate_size")
    return [
        _linear(f"{prefix}.gate_proj", g.intermediate_size, g.hidden_size, quantized, up_dims),
        _linear(f"{prefix}.up_proj", g.intermediate_size, g.hidden_size, quantized, up_dims),
        _linear(f"{prefix}.down_proj", g.hidden_size, g.intermediate_size, quantized, down_dims),
    ]


def _decoder_layer(g: Geometry, prefix: str, layer_type: str, quantized: bool) -> list[WeightSpec]:
    mixer = (
        _linear_attention(g, f"{prefix}.linear_attn")
        if layer_type == "linear_attention"
        else _full_attention(g, f"{prefix}.self_attn", quantized)
    )
    return [
        _norm(f"{prefix}.input_layernorm", g.hidden_size),
        *mixer,
        _norm(f"{prefix}.post_attention_layernorm", g.hidden_size),
        *_mlp(g, f"{prefix}.mlp", quantized),
    ]


def checkpoint_layout(g: Geometry) -> list[WeightSpec]:
    """All tensors in file order: embedding, decoder layers, final norm, lm_head, MTP head."""
    hidden = g.hidden_size
    specs = [
        WeightSpec(
            f"{DECODER_PREFIX}.embed_tokens.weight",
            (g.vocab_size, hidden),
            Init.NORMAL,
            Kind.EMBEDDING,
        )
    ]
    for index, layer_type in enumerate(g.layer_types):
        specs += _decoder_layer(g, f"{DECODER_PREFIX}.layers.{index}", layer_type, True)
    specs.append(_norm(f"{DECODER_PREFIX}.norm", hidden))
    specs.append(_linear("lm_head", g.vocab_size, hidden, False))
    if g.mtp_num_hidden_layers:
        # The MTP head reads the decoder's embedding and lm_head; it owns only these.
        specs.append(_linear(f"{MTP_PREFIX}.fc", hidden, 2 * hidden, False))
        specs.append(_norm(f"{MTP_PREFIX}.pre_fc_norm_embedding", hidden))
        specs.append(_norm(f"{MTP_PREFIX}.pre_fc_norm_hidden", hidden))
        for index in range(g.mtp_num_hidden_layers):
            specs += _decoder_layer(g, f"{MTP_PREFIX}.layers.{index}", "full_attention", False)
        specs.append(_norm(f"{MTP_PREFIX}.norm", hidden))
    return specs


def vision_linear_modules() -> list[str]:
    blocks = [
        f"{VISION_PREFIX}.blocks.{index}.{linear}"
        for index in range(VISION_DEPTH)
        for linear in ("attn.qkv", "attn.proj", "mlp.linear_fc1", "mlp.linear_fc2")
    ]
    return [*blocks, f"{VISION_PREFIX}.merger.linear_fc1", f"{VISION_PREFIX}.merger.linear_fc2"]


def unquantized_modules(specs: list[WeightSpec]) -> list[str]:
    """Linear and embedding modules kept in bf16: the `ignore` list of the quantization config."""
    text_modules = [
        spec.module
        for spec in specs
        if spec.kind in (Kind.LINEAR, Kind.EMBEDDING) and not spec.quantized
    ]
    return vision_linear_modules() + text_modules

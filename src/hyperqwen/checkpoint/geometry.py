"""The shape of a Qwen3.5 text model: one frozen dataclass, two presets, `key=value` overrides.

Field names are the `text_config` keys of a real Qwen3.5 `config.json`, so `--set` speaks the
same language as the checkpoint it produces. Layer types follow the real model: three Gated
DeltaNet (`linear_attention`) layers, then one `full_attention` layer, repeating.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any

# config.json's model_type of a Qwen3.5 checkpoint, and its text_config's.
MODEL_TYPE = "qwen3_5"
TEXT_MODEL_TYPE = "qwen3_5_text"


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The text model's keys of a config.json: its `text_config` (a multimodal Qwen3.5
    checkpoint's) or the whole file (a text-only one's)."""
    return config.get("text_config") or config


class GeometryError(ValueError):
    """A geometry vLLM's qwen3_5 model or its kernels would reject; the message names the knob."""


@dataclass(frozen=True)
class Geometry:
    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    full_attention_interval: int = 4
    vocab_size: int = 248_320
    partial_rotary_factor: float = 0.25
    rope_theta: float = 10_000_000.0
    max_position_embeddings: int = 262_144
    rms_norm_eps: float = 1e-6
    mtp_num_hidden_layers: int = 1

    @property
    def layer_types(self) -> list[str]:
        return [
            "full_attention"
            if (index + 1) % self.full_attention_interval == 0
            else "linear_attention"
            for index in range(self.num_hidden_layers)
        ]

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def mrope_section(self) -> list[int]:
        """Rotary pairs split over (time, height, width); 64 rotary dims give [11, 11, 10]."""
        pairs = self.rotary_dim // 2
        base, extra = divmod(pairs, 3)
        return [base + (1 if axis < extra else 0) for axis in range(3)]

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @classmethod
    def from_text_config(cls, text: Mapping[str, Any]) -> Geometry:
        """The geometry a Qwen3.5 config.json's text_config describes (the rotary keys may sit
        in its rope_parameters). GeometryError for a shape vLLM cannot build or a layer layout
        other than three linear_attention layers then one full_attention layer, repeating."""
        values = {**text.get("rope_parameters", {}), **text}
        known = {field.name: values[field.name] for field in fields(cls) if field.name in values}
        try:
            geometry = cls(**known).validate(tokenizer_size=0)
        except (GeometryError, TypeError) as error:
            raise GeometryError(f"unexpected geometry: {error}") from None
        if text.get("layer_types", geometry.layer_types) != geometry.layer_types:
            raise GeometryError(
                "layer_types is not three linear_attention layers then one full_attention "
                f"layer, repeating (full_attention_interval={geometry.full_attention_interval}): "
                "an unexpected layer layout"
            )
        return geometry

    def validate(self, tokenizer_size: int) -> Geometry:
        """Raise GeometryError for shapes vLLM cannot build; return self so calls chain."""
        problems = [
            f"{field.name}={getattr(self, field.name)} must be > 0"
            for field in fields(self)
            if field.name != "mtp_num_hidden_layers" and getattr(self, field.name) <= 0
        ]
        if self.mtp_num_hidden_layers < 0:
            problems.append("mtp_num_hidden_layers must be >= 0")
        if problems:
            raise GeometryError("; ".join(problems))
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads} (grouped-query attention)"
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            problems.append(
                f"linear_num_value_heads={self.linear_num_value_heads} must be a multiple of "
                f"linear_num_key_heads={self.linear_num_key_heads} (Gated DeltaNet head groups)"
            )
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2 or self.rotary_dim < 6:
            problems.append(
                f"head_dim × partial_rotary_factor = {self.rotary_dim} must be an even number "
                ">= 6 (interleaved M-RoPE splits the rotary pairs over three axes)"
            )
        if "full_attention" not in self.layer_types:
            problems.append(
                f"full_attention_interval={self.full_attention_interval} leaves no full-attention "
                f"layer in num_hidden_layers={self.num_hidden_layers}; vLLM needs at least one"
            )
        if self.vocab_size < tokenizer_size:
            problems.append(
                f"vocab_size={self.vocab_size} is smaller than the tokenizer ({tokenizer_size} "
                "tokens); the embedding needs a row for every token id"
            )
        if problems:
            raise GeometryError("; ".join(problems))
        return self

    def with_overrides(self, assignments: Iterable[str]) -> Geometry:
        """Apply `key=value` strings (the `--set` flag); values are parsed as the field's type."""
        types = {field.name: field.type for field in fields(self)}
        changes: dict[str, int | float] = {}
        for assignment in assignments:
            key, separator, raw_value = assignment.partition("=")
            key = key.strip().replace("-", "_")
            if not separator or key not in types:
                raise GeometryError(
                    f"--set {assignment!r}: expected KEY=VALUE with KEY one of: " + ", ".join(types)
                )
            parse = float if types[key] == "float" else int
            try:
                changes[key] = parse(raw_value.strip())
            except ValueError:
                raise GeometryError(
                    f"--set {assignment!r}: {key} takes a {parse.__name__}, got {raw_value!r}"
                ) from None
        return dataclasses.replace(self, **changes)


PRESETS: dict[str, Geometry] = {
    # Same structure as the real model (3 GDN + 1 attention layer per block, 3 GDN value heads
    # per key head, head_dim 256, one MTP layer, the full vocabulary) at a size a CPU writes in
    # seconds.
    # Every quantized linear keeps both dimensions a multiple of 128 so Machete and Marlin
    # (vLLM's W4A16 kernels on Hopper and older cards) accept it.
    "tiny": Geometry(
        num_hidden_layers=4,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=2,
        linear_num_value_heads=6,
    ),
    # The real Qwen3.5/3.6 27B text model.
    "27b": Geometry(
        num_hidden_layers=64,
        hidden_size=5120,
        intermediate_size=17408,
        num_attention_heads=24,
        num_key_value_heads=4,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=48,
    ),
}

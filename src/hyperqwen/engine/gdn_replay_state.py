"""The GDN layers' state page under the replay verify (engine/quoting.md's plan, item 1).

vLLM 0.26 gives a GDN layer under speculative decoding 1 + W state blocks per request
(MambaSpec.num_speculative_blocks = W, from the speculative config). The replay verify
(kernels/gdn_replay.py) needs one, plus the last verify's inputs: k, v, a and b of 1 + W
tokens. Those become four more state tensors of the layer's page, after vLLM's conv and
recurrent state, so that vLLM sizes, profiles and allocates them per block and a request's
saved inputs sit in its state block: the slot the replay reads is the block.

vLLM computes the page twice, and both must agree (MambaSpec asserts the padded page is at
least the layer's): once from the model class's `get_mamba_state_shape_from_config` /
`get_mamba_state_dtype_from_config` (Platform._align_hybrid_block_size, which sizes the
attention block to hold the page), and once per layer from `get_state_shape` /
`get_state_dtype` (MambaBase.get_kv_cache_spec). The first is the model class's: the vLLM
plugin registers the subclasses below in vLLM's model registry under the same architecture
names. The second is the layer instance's: `replay_layer` sets it at the gdn_layer_built seam,
with `num_speculative_blocks = 0` in its spec.

The conv state keeps its W extra columns (vLLM's causal_conv1d_update shifts its window by the
accepted count; quoting.md: not worth a change). Runs inside vLLM.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

# The saved inputs' names, in the order they follow vLLM's (conv, recurrent) state tensors
SAVED_INPUTS = ("k", "v", "a", "b")
FIRST_SAVED = 2  # index of saved k among a GDN layer's state tensors


def saved_input_shapes(
    tp: int, k_heads: int, v_heads: int, k_dim: int, v_dim: int, drafts: int
) -> tuple[tuple[int, ...], ...]:
    """One block's saved k [1 + W, H, K], v [1 + W, HV, V], a and b [1 + W, HV], heads per
    tensor-parallel rank: kernels/gdn_replay.py's ReplayBuffer per slot."""
    tokens = 1 + drafts
    heads, value_heads = k_heads // tp, v_heads // tp
    return (
        (tokens, heads, k_dim),
        (tokens, value_heads, v_dim),
        (tokens, value_heads),
        (tokens, value_heads),
    )


def _drafts(vllm_config: Any) -> int:
    speculative = vllm_config.speculative_config
    return speculative.num_speculative_tokens if speculative else 0


def _activation_dtype(model_dtype: Any) -> torch.dtype:
    # the layer's k, v, a, b are in the model dtype; ModelConfig resolves it to a torch dtype
    if not isinstance(model_dtype, torch.dtype):
        raise TypeError(f"GDN replay: the model dtype must be resolved, got {model_dtype!r}")
    return model_dtype


def model_state_shapes(vllm_config: Any, vllms: tuple) -> tuple[tuple[int, ...], ...]:
    """The model class's state shapes (vLLM's, then the saved inputs), from its config; vLLM's
    alone without speculation, as its layers keep then (gdn_replay.gdn_layer_built)."""
    if not _drafts(vllm_config):
        return vllms
    text = vllm_config.model_config.hf_text_config
    saved = saved_input_shapes(
        vllm_config.parallel_config.tensor_parallel_size,
        text.linear_num_key_heads,
        text.linear_num_value_heads,
        text.linear_key_head_dim,
        text.linear_value_head_dim,
        _drafts(vllm_config),
    )
    return (*vllms, *saved)


def model_state_dtypes(vllm_config: Any, vllms: tuple) -> tuple[torch.dtype, ...]:
    if not _drafts(vllm_config):
        return vllms
    dtype = _activation_dtype(vllm_config.model_config.dtype)
    return (*vllms, *(dtype,) * len(SAVED_INPUTS))


def replay_layer(layer: Any) -> None:
    """Gives a vLLM GDN layer instance the replay page: its state shapes and dtypes with the
    saved inputs, and a KV-cache spec of one block per request (no speculative blocks). vLLM's
    prefill warm-up still sees its own two state dtypes."""
    vllms_shape, vllms_dtype, vllms_spec = (
        layer.get_state_shape,
        layer.get_state_dtype,
        layer.get_kv_cache_spec,
    )
    saved = saved_input_shapes(
        layer.tp_size,
        layer.num_k_heads,
        layer.num_v_heads,
        layer.head_k_dim,
        layer.head_v_dim,
        layer.num_spec,
    )
    dtype = _activation_dtype(layer.model_config.dtype)

    def get_state_shape() -> tuple[tuple[int, ...], ...]:
        return (*vllms_shape(), *saved)

    def get_state_dtype() -> tuple[torch.dtype, ...]:
        return (*vllms_dtype(), *(dtype,) * len(SAVED_INPUTS))

    def get_kv_cache_spec(vllm_config: Any) -> Any:
        return dataclasses.replace(vllms_spec(vllm_config), num_speculative_blocks=0)

    vllms_warmup = layer._warmup_prefill_kernels

    def warmup_prefill_kernels(*args: Any, **kwargs: Any) -> None:
        # vLLM's prefill warm-up (its profiling run) unpacks (conv, recurrent) state dtypes
        layer.get_state_dtype = vllms_dtype
        try:
            vllms_warmup(*args, **kwargs)
        finally:
            layer.get_state_dtype = get_state_dtype

    # instance attributes shadow the class's methods for every caller of this layer
    layer.get_state_shape = get_state_shape
    layer.get_state_dtype = get_state_dtype
    layer.get_kv_cache_spec = get_kv_cache_spec
    layer._warmup_prefill_kernels = warmup_prefill_kernels


def replay_model_class(vllms: type) -> type:
    """A subclass of vLLM's Qwen3.5 model class whose config-time state page holds the saved
    inputs (what the hybrid page alignment sizes the attention block by), and whose `align`
    state copies are the conv state's."""

    class ReplayModel(vllms):  # type: ignore[misc, valid-type]
        def __init__(self, *, vllm_config: Any, prefix: str = "model") -> None:
            super().__init__(vllm_config=vllm_config, prefix=prefix)
            self.hyperqwen_replay_page = bool(_drafts(vllm_config))

        def get_mamba_state_copy_func(self) -> tuple:  # type: ignore[override]
            """vLLM's runner asks the instance: with the replay page, its `align` copies move
            the conv state alone (vLLM's function). The recurrent state's copies are folds of
            the saved inputs, which always consume them (gdn_replay_align.py), and vLLM's
            copies size their lists from these functions, one per state tensor in order."""
            vllms_funcs = super().get_mamba_state_copy_func()
            return vllms_funcs[:1] if self.hyperqwen_replay_page else vllms_funcs

        @classmethod
        def get_mamba_state_shape_from_config(cls, vllm_config):
            vllm_shapes = super().get_mamba_state_shape_from_config(vllm_config)
            return model_state_shapes(vllm_config, vllm_shapes)

        @classmethod
        def get_mamba_state_dtype_from_config(cls, vllm_config):
            vllm_dtypes = super().get_mamba_state_dtype_from_config(vllm_config)
            return model_state_dtypes(vllm_config, vllm_dtypes)

    ReplayModel.__name__ = ReplayModel.__qualname__ = vllms.__name__
    return ReplayModel


def saved_inputs(kv_cache: Any) -> tuple[Any, ...]:
    """A replay layer's saved k, v, a, b pools (each [blocks, 1 + W, ...]), from its state
    tensors as vLLM bound them (views of the page, slots a page apart)."""
    return tuple(kv_cache[FIRST_SAVED : FIRST_SAVED + len(SAVED_INPUTS)])

"""KV=kvarn inside vLLM: the KVarN attention backend (../kvarn/backend.py) registered under
vLLM's CUSTOM slot, and its pages declared at the attention_kv_spec seam.

The vLLM plugin (../vllm_plugin.py) calls `register` when HYPERQWEN_KV_KVARN=1; the launcher
passes `--attention-backend CUSTOM`, so vLLM's Attention layers (the full-attention ones) take
the backend, and this seam gives their KV cache spec and the hybrid alignment's bytes per token.
"""

from __future__ import annotations

from typing import Any

BACKEND_PATH = "hyperqwen.kvarn.backend.KVarNBackend"


def register() -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)


def attention_kv_spec(backend: Any, block_size: int, num_kv_heads: int, head_size: int) -> Any:
    """KVarN's uint8 pages for a layer on its backend; None for any other backend."""
    from hyperqwen.kvarn.backend import KVarNBackend

    if backend is not KVarNBackend:
        return None
    return KVarNBackend.kv_cache_spec(block_size, num_kv_heads, head_size)

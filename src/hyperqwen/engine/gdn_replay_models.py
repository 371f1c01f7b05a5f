"""vLLM's Qwen3.5 model classes with the replay verify's state page (gdn_replay_state.py), under
their own architecture names: what the vLLM plugin registers in vLLM's model registry, by
this module's path, so that vLLM imports it (and its own model module) only where it resolves
one of these architectures. Runs inside vLLM."""

from __future__ import annotations

from vllm.model_executor.models.qwen3_5 import (
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeForConditionalGeneration,
)

from hyperqwen.engine.gdn_replay_state import replay_model_class

ReplayQwen3_5 = replay_model_class(Qwen3_5ForConditionalGeneration)
ReplayQwen3_5Moe = replay_model_class(Qwen3_5MoeForConditionalGeneration)

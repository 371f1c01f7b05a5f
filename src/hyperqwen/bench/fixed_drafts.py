"""A vLLM 0.26 drafter that proposes every decoding request's full `num_speculative_tokens`,
every step: `bench quoting-ceiling` times verify steps of exactly k + 1 tokens with it.

vLLM loads it through its own seam, no patch: `--speculative-config
'{"method":"custom_class","model":"hyperqwen.bench.fixed_drafts.FixedDrafts",...}'`
(vllm/v1/spec_decode/custom_class_proposer.py constructs it with the VllmConfig; the V1 runner
calls `propose` where it calls the n-gram drafter's). The drafts repeat the request's last
sampled token: what they are does not matter, as the server runs synthetic rejection sampling
at rate 1.0, which accepts every draft whatever the weights say. Drafting costs a list per
request on the host, so a step's time is the verify's.
"""

from __future__ import annotations

from collections.abc import Sequence


class FixedDrafts:
    def __init__(self, vllm_config) -> None:
        self.k = vllm_config.speculative_config.num_speculative_tokens
        self.max_model_len = vllm_config.model_config.max_model_len

    def propose(
        self,
        sampled_token_ids: Sequence[Sequence[int]],
        num_tokens_no_spec: Sequence[int],
        token_ids_cpu,
        slot_mappings=None,
    ) -> list[list[int]]:
        """k drafts per request that sampled a token this step (none for a prefill chunk),
        fewer only where the context would pass max_model_len (vLLM's n-gram drafter's cap)."""
        drafts = []
        # num_tokens_no_spec has a slot per batch row vLLM can hold: zip stops at the requests
        for sampled, length in zip(sampled_token_ids, num_tokens_no_spec, strict=False):
            room = min(self.k, self.max_model_len - int(length))
            drafts.append([sampled[-1]] * room if sampled and room > 0 else [])
        return drafts

    def load_model(self, *args, **kwargs) -> None:
        """Nothing to load: vLLM calls this on every drafter."""

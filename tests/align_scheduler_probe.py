"""Drives vLLM's own V1 scheduler and KV-cache manager on the CPU, in prefix caching's mamba
"align" mode, through requests of chosen prompts; prints per request its prefill chunks and
cache hit as JSON. Run as `python align_scheduler_probe.py CHECKPOINT SCENARIO_JSON` with the
vLLM under test first on PYTHONPATH (tests/test_engine_align_whole_prompt.py).

SCENARIO_JSON: {"runs": {name: {"env": {VAR: value}, "prompts": [[token ids], ...]}}}; each run
gets a fresh scheduler, and each prompt arrives once the one before it has its first token.

On the way it checks the condition align mode's correctness rests on: a GDN state block is
cached (gets a block hash) only where a step of the request that computed it ended; it exits
with an error naming the block otherwise.
"""

from __future__ import annotations

import json
import os
import sys

import torch

BLOCK = 16
BUDGET = 256
MAX_LEN = 2048
POOL_BLOCKS = 400


def make_scheduler(checkpoint: str):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    init_none_hash(sha256)  # the chain's first hash, drawn at random: once per scheduler
    config = EngineArgs(
        model=checkpoint,
        language_model_only=True,
        block_size=BLOCK,
        max_model_len=MAX_LEN,
        max_num_batched_tokens=BUDGET,
        max_num_seqs=8,
        enable_prefix_caching=True,
    ).create_engine_config()
    return Scheduler(config, align_pool(config, POOL_BLOCKS), StructuredOutputManager(config),
                     block_size=BLOCK)  # fmt: skip


def align_pool(config, num_blocks: int, speculative_blocks: int = 0):
    """A pool of `num_blocks` for one small attention layer and one GDN layer in "align" mode
    (and the drafts' state blocks), set in `config` too."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
    )

    assert config.cache_config.mamba_cache_mode == "align", config.cache_config.mamba_cache_mode
    config.cache_config.num_gpu_blocks = num_blocks
    attention = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=64,
                                  dtype=torch.bfloat16)  # fmt: skip
    state = MambaSpec(shapes=((4, 4),), dtypes=(torch.bfloat16,), block_size=BLOCK,
                      mamba_cache_mode="align",
                      num_speculative_blocks=speculative_blocks)  # fmt: skip
    groups = [KVCacheGroupSpec(["attention"], attention), KVCacheGroupSpec(["gdn"], state)]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


def new_request(index: int, prompt: list[int]):
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    return Request(
        request_id=f"r{index}",
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=2, ignore_eos=True),
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )


def check_cached_states(scheduler, chunk_ends: dict[str, set[int]], seen: set) -> None:
    """Every state block newly holding a hash was filled by a step ending at its boundary."""
    state_manager = scheduler.kv_cache_manager.coordinator.single_type_managers[1]
    for request_id, blocks in state_manager.req_to_blocks.items():
        for index, block in enumerate(blocks):
            key = (block.block_id, block.block_hash)
            if block.is_null or block.block_hash is None or key in seen:
                continue
            seen.add(key)
            boundary = (index + 1) * BLOCK
            ends = sorted(chunk_ends[request_id])
            if boundary not in ends:
                sys.exit(f"{request_id}: state block {index} cached, no step ended at {boundary} "
                         f"(steps ended at {ends})")  # fmt: skip


def step(scheduler, chunk_ends: dict[str, set[int]], chunks: dict[str, list[list[int]]]) -> None:
    from vllm.v1.outputs import ModelRunnerOutput

    output = scheduler.schedule()
    request_ids = list(output.num_scheduled_tokens)
    sampled = []
    for request_id in request_ids:
        request = scheduler.requests[request_id]
        count = output.num_scheduled_tokens[request_id]
        end = request.num_computed_tokens  # the scheduler already counted this step
        chunk_ends[request_id].add(end)
        if end - count < request.num_prompt_tokens:
            chunks[request_id].append([end - count, count])
        sampled.append([7] if end >= request.num_tokens else [])
    runner_output = ModelRunnerOutput(
        req_ids=request_ids,
        req_id_to_index={request_id: i for i, request_id in enumerate(request_ids)},
        sampled_token_ids=sampled,
    )
    scheduler.update_from_output(output, runner_output)


def run(checkpoint: str, prompts: list[list[int]]) -> dict[str, list[list[int]]]:
    scheduler = make_scheduler(checkpoint)
    chunk_ends: dict[str, set[int]] = {}
    chunks: dict[str, list[list[int]]] = {}
    seen: set = set()
    result = {}
    for index, prompt in enumerate(prompts):
        request = new_request(index, prompt)
        chunk_ends[request.request_id] = set()
        chunks[request.request_id] = []
        scheduler.add_request(request)
        while not request.output_token_ids:
            step(scheduler, chunk_ends, chunks)
            check_cached_states(scheduler, chunk_ends, seen)
        result[request.request_id] = chunks[request.request_id]
    while scheduler.has_unfinished_requests():
        step(scheduler, chunk_ends, chunks)
        check_cached_states(scheduler, chunk_ends, seen)
    return result


def main() -> None:
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform

    platforms._current_platform = CpuPlatform()
    checkpoint, scenario = sys.argv[1], json.loads(sys.argv[2])
    results = {}
    for name, spec in scenario["runs"].items():
        os.environ.update(spec["env"])
        results[name] = run(checkpoint, spec["prompts"])
    print(json.dumps(results))


if __name__ == "__main__":
    main()

"""Drives vLLM's own async scheduler and KV-cache manager on the CPU through one long prompt, in
prefix caching's mamba "align" mode with MTP's speculative state blocks and a step in flight
(async scheduling keeps two): prints as JSON the most GDN state blocks the request held at once
and the request's preemptions. Run as `python align_retire_probe.py
CHECKPOINT STATE_BLOCKS` with the vLLM under test first on PYTHONPATH
(tests/test_mamba_align_retire.py): the pool holds the prompt's attention blocks and
STATE_BLOCKS for the GDN group."""

from __future__ import annotations

import json
import sys

from align_scheduler_probe import BLOCK, align_pool, new_request

CHUNK_BLOCKS = 2
PROMPT = 48 * CHUNK_BLOCKS * BLOCK  # 48 chunks
SPECULATIVE = 3
IN_FLIGHT = 2  # scheduled steps not yet answered: async scheduling's batch queue
# the prompt's attention blocks (its first token and the drafts' lookahead too)
ATTENTION_BLOCKS = (PROMPT + 1 + SPECULATIVE) // BLOCK + 1


def make_scheduler(checkpoint: str, pool_blocks: int):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.structured_output import StructuredOutputManager

    init_none_hash(sha256)
    config = EngineArgs(
        model=checkpoint,
        language_model_only=True,
        block_size=BLOCK,
        max_model_len=2 * PROMPT,
        max_num_batched_tokens=CHUNK_BLOCKS * BLOCK,
        max_num_seqs=1,
        enable_prefix_caching=True,
        async_scheduling=True,
        speculative_config={"method": "mtp", "num_speculative_tokens": SPECULATIVE},
    ).create_engine_config()
    pool = align_pool(config, pool_blocks, SPECULATIVE)
    return AsyncScheduler(config, pool, StructuredOutputManager(config), block_size=BLOCK)


def answer(scheduler, output) -> None:
    """The model runner's reply to one scheduled step: a token where the prompt is done."""
    from vllm.v1.outputs import ModelRunnerOutput

    request_ids = list(output.num_scheduled_tokens)
    sampled = []
    for request_id in request_ids:
        request = scheduler.requests[request_id]
        done = (request.num_computed_tokens - request.num_in_flight_tokens
                + output.num_scheduled_tokens[request_id])  # fmt: skip
        sampled.append([7] if done >= request.num_prompt_tokens else [])
    scheduler.update_from_output(output, ModelRunnerOutput(
        req_ids=request_ids,
        req_id_to_index={request_id: i for i, request_id in enumerate(request_ids)},
        sampled_token_ids=sampled,
    ))  # fmt: skip


def run(checkpoint: str, state_blocks: int) -> dict:
    """The prompt in a pool of its attention blocks and `state_blocks` for the GDN group."""
    scheduler = make_scheduler(checkpoint, ATTENTION_BLOCKS + state_blocks + 1)  # + the null block
    request = new_request(0, [1000 + i % 5000 for i in range(PROMPT)])
    scheduler.add_request(request)
    states = scheduler.kv_cache_manager.coordinator.single_type_managers[1]
    in_flight, steps, most_states = [], 0, 0
    while (scheduler.has_unfinished_requests() or in_flight) and steps < 20 * PROMPT // BLOCK:
        while scheduler.has_requests() and len(in_flight) < IN_FLIGHT:
            in_flight.append(scheduler.schedule())
            steps += 1
            held = states.req_to_blocks.get(request.request_id, [])
            most_states = max(most_states, sum(not block.is_null for block in held))
        if in_flight:
            answer(scheduler, in_flight.pop(0))
    return {
        "steps": steps,
        "finished": not scheduler.has_unfinished_requests(),
        "most_state_blocks": most_states,
        "preemptions": request.num_preemptions,
    }


def main() -> None:
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform

    platforms._current_platform = CpuPlatform()
    print(json.dumps(run(sys.argv[1], int(sys.argv[2]))))


if __name__ == "__main__":
    main()

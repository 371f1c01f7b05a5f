"""patches/runner-host-block-table.patch through vLLM's own runner code, on the CPU.

The V1 runner's `GPUModelRunner._build_attention_metadata` (the patched function itself, from
the series applied to a pristine vLLM) runs on a stand-in for the runner instance that holds
vLLM's real parts: a `MultiGroupBlockTable` of two KV cache groups, its `CpuGpuBuffer`s (the
"device" side is a second CPU tensor, copied by `commit_block_table` as on a GPU) and
`AttentionGroup`s whose builders are KVarN's. The step is laid out as vLLM's runner leaves it:
an earlier step committed three requests, this one has two (the third's row left stale on
both sides, as `condense` leaves it) and one padding request (as for a CUDA graph). Each
group's builder must get the host rows of its own group, equal to the device rows it plans
for, the padding row NULL_BLOCK_ID on both, as a view of the runner's host buffer (no copy),
and plan its stores from them; `unpadded` (the drafter's metadata) keeps the real rows.
"""

from __future__ import annotations

from test_patches import run_on_tree

PROBE = """
import json, types
import torch
from vllm.config import VllmConfig
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
from vllm.v1.utils import CpuGpuBuffer
from vllm.v1.worker.block_table import MultiGroupBlockTable
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.utils import AttentionGroup

from hyperqwen.kvarn.backend import KVarNBackend

T = 128
cpu = torch.device("cpu")
spec = KVarNBackend.kv_cache_spec(T, 2, 32)
seen, groups = {}, []
for gid in range(2):
    group = AttentionGroup(KVarNBackend, [f"layer{gid}"], spec, gid)
    config = VllmConfig()
    config.cache_config.num_gpu_blocks, config.cache_config.block_size = 10, T
    group.create_metadata_builders(config, cpu)
    builder = group.get_metadata_builder()

    def record(common_prefix_len, common_attn_metadata, fast_build=False, _b=builder, _g=gid):
        seen[_g] = common_attn_metadata
        return type(_b).build(_b, common_prefix_len, common_attn_metadata, fast_build)

    builder.build = record
    groups.append([group])

tables = MultiGroupBlockTable(4, 1024, False, cpu, [T, T], [T, T], [4, 4])
tables.add_row(([3, 5], [6, 2]), 0)
tables.add_row(([4], [7]), 1)
tables.add_row(([9, 8], [8, 9]), 2)
tables.commit_block_table(3)  # an earlier step with three requests
# this step: the third request is gone (its row stale on both sides); request 0 prefills 256
# tokens (fills its tiles 0 and 1), request 1 100 tokens; one padding request
tables.commit_block_table(2)  # as _prepare_inputs does
starts = CpuGpuBuffer(5, dtype=torch.int32, device=cpu, pin_memory=False)
starts.cpu[:4] = torch.tensor([0, 256, 356, 356])
starts.gpu.copy_(starts.cpu)


def slot_mapping(first, second):
    slots = [first[p // T] * T + p % T for p in range(256)] + [second * T + p for p in range(100)]
    return torch.tensor(slots + [-1])


kv_cache_groups = [KVCacheGroupSpec([f"layer{gid}"], spec) for gid in range(2)]
runner = types.SimpleNamespace(
    kv_cache_config=KVCacheConfig(10, [], kv_cache_groups),
    input_batch=types.SimpleNamespace(
        block_table=tables,
        num_computed_tokens_cpu_tensor=torch.zeros(4, dtype=torch.int32),
        num_prompt_tokens_cpu_tensor=torch.tensor([300, 100, 0, 0], dtype=torch.int32),
    ),
    optimistic_seq_lens_cpu=torch.tensor([256, 100, 0, 0], dtype=torch.int32),
    routed_experts_initialized=False,
    use_async_spec_decode=False,
    is_mm_prefix_lm=False,
    model_config=types.SimpleNamespace(rswa_window=None),
    query_start_loc=starts,
    seq_lens=torch.tensor([256, 100, 0], dtype=torch.int32),
    positions=torch.zeros(357, dtype=torch.int64),
    dcp_world_size=1,
    attn_groups=groups,
    speculative_config=None,
    device=cpu,
)
runner._get_encoder_seq_lens = types.MethodType(GPUModelRunner._get_encoder_seq_lens, runner)
metadata, _ = GPUModelRunner._build_attention_metadata(
    runner, num_tokens=356, num_reqs=2, max_query_len=256, num_tokens_padded=357,
    num_reqs_padded=3, slot_mappings={0: slot_mapping([3, 5], 4), 1: slot_mapping([6, 2], 7)},
)
out = {}
for gid in range(2):
    cam = seen[gid]
    host = cam.block_table_cpu
    out[gid] = dict(
        host=None if host is None else host.tolist(),
        device=cam.block_table_tensor.tolist(),
        view_of_runner_buffer=host is not None
        and host.data_ptr() == tables[gid].block_table.cpu.data_ptr(),
        unpadded=cam.unpadded(356, 2).block_table_cpu.tolist(),
        stores=metadata[f"layer{gid}"].store_blocks.tolist(),
    )
print(json.dumps(out))
"""


def test_the_runner_gives_each_groups_builder_its_host_rows(patched_vllm):
    seen = run_on_tree(patched_vllm, PROBE)
    for gid, (rows, stores) in {"0": ([[3, 5], [4]], [3, 5]), "1": ([[6, 2], [7]], [6, 2])}.items():
        want = [row + [0] * (4 - len(row)) for row in rows]
        group = seen[gid]
        assert group["host"] == [*want, [0, 0, 0, 0]], gid  # padding: NULL_BLOCK_ID, not stale
        assert group["device"] == group["host"], gid
        assert group["view_of_runner_buffer"], gid
        assert group["unpadded"] == want, gid
        assert group["stores"] == [*stores, -1], gid  # padded to one entry per request

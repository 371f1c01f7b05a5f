"""GDN replay under prefix caching's `align` mode, wired: the runner seams at vLLM 0.26's two
align copies (engine/gdn_replay.py `runner_align_copies` / `runner_align_copied`, through
seams.py) over a run of steps, against vLLM's per-token-state path.

Two worlds see the same requests, block tables, rows and inputs (random, never zeros), with
blocks of 4 tokens and 3 drafts, so requests cross blocks every step or two. Each runs vLLM's
own align code, v1/worker/mamba_utils.py with Triton itself (the interpreter): its host move
(`preprocess_mamba`), the GDN builder, a verify, and its fused postprocess
(`postprocess_mamba_align_gpu`, the boundary copy), on the runner's attributes those read (the
runner itself cannot run here). vLLM's world: 1 + W state blocks per request, the model's two
copy functions, its verify kernel with per-token states. Ours: the replay page bound as vLLM
binds it, our builder, the replay model's copy functions, and the seams. A prefill writes the
same fresh state and conv window in both.

After each copy, every block whose recurrent state ours holds whole (written, not `saved`) must
equal vLLM's, and every block vLLM moved or copied a state to must be one of them; vLLM's
decisions (running columns, accepted counts) must be the same in both worlds, the conv pools
equal bit for bit, every verify's outputs close. The run has moves that fold saved tokens and
moves of a whole state, boundary copies into an earlier block and in place, and a new request
hitting the cache on a block a boundary fold wrote while that block's last verify was saved.
"""

from __future__ import annotations

import random

import pytest
import torch
from test_engine_gdn_replay import DRAFTS
from test_engine_gdn_replay_align import vllms_mamba_utils
from test_engine_gdn_replay_seam import bound_page
from test_engine_gdn_replay_wire import (
    gdn_layer,
    vllm_config,
    vllm_on_cpu,  # noqa: F401 (a fixture this module uses)
)
from test_kernel_gdn_recurrent import POISON, vllms_kernel

from hyperqwen.checkpoint.geometry import PRESETS

BLOCK = 4
WIDTH = 1 + DRAFTS
HEADS, V_HEADS, DIM = 2, 4, 32
COLUMNS = 14  # blocks per request's row
REQUESTS = 8
BLOCKS = 1 + 5 * COLUMNS  # block 0 is the null block


class BlockTable:
    """The runner's persistent block table of one group (its device tensor, rows in batch
    order), as vLLM's fused postprocess binds it once by address."""

    def __init__(self):
        self.table = torch.zeros((REQUESTS, COLUMNS), dtype=torch.int32)

    def get_device_tensor(self, num_reqs: int) -> torch.Tensor:
        return self.table[:num_reqs]


class InputBatch:
    def __init__(self):
        self.req_ids: list[str] = []
        self.num_accepted_tokens_cpu_tensor = torch.ones(REQUESTS, dtype=torch.int32)
        self.num_accepted_tokens_cpu = self.num_accepted_tokens_cpu_tensor.numpy()
        self.block_table = [BlockTable()]


class World:
    """One runner's align state (its attributes vLLM's align functions and the seams read), its
    layer's states, its builder."""

    def __init__(self, replay: bool, requests: dict, shared: dict, mamba_utils):
        from vllm.model_executor.models.qwen3_5 import Qwen3_5ForConditionalGeneration
        from vllm.v1.attention.backends.gdn_attn import GDNAttentionBackend
        from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.utils import CpuGpuBuffer
        from vllm.v1.worker.utils import AttentionGroup

        from hyperqwen.engine import gdn_replay
        from hyperqwen.engine.gdn_replay_backend import ReplayGDNBackend
        from hyperqwen.engine.gdn_replay_models import ReplayQwen3_5

        self.replay = replay
        config = vllm_config(DRAFTS)
        cache = config.cache_config
        cache.mamba_block_size, cache.mamba_cache_mode = BLOCK, "align"
        cache.enable_prefix_caching = True
        cache.mamba_ssm_cache_dtype = "float32"  # as the launcher serves
        self.cache_config = cache
        self.compilation_config = config.compilation_config
        layer = gdn_layer(shared["geometry"], config)
        layer.A_log, layer.dt_bias = shared["A_log"], shared["dt_bias"]
        if replay:
            gdn_replay.gdn_layer_built(layer)
            spec = layer.get_kv_cache_spec(config)
            layer.kv_cache = bound_page(spec, BLOCKS)  # every state NaN
            layer.kv_cache[0].copy_(shared["conv"])
            # the replay model's copy functions, as the runner asks the instance for them
            model = ReplayQwen3_5.__new__(ReplayQwen3_5)
            torch.nn.Module.__init__(model)
            model.hyperqwen_replay_page = True  # what __init__ sets with drafts
            self.copy_funcs = model.get_mamba_state_copy_func()
            backend = ReplayGDNBackend
        else:
            spec = layer.get_kv_cache_spec(config)
            state = torch.full((BLOCKS, V_HEADS, DIM, DIM), POISON)
            layer.kv_cache = [shared["conv"].clone(), state]
            self.copy_funcs = Qwen3_5ForConditionalGeneration.get_mamba_state_copy_func()
            backend = GDNAttentionBackend
        assert spec.block_size == BLOCK and spec.num_speculative_blocks == (0 if replay else DRAFTS)
        self.layer = layer
        self.compilation_config.static_forward_context["gdn"] = layer
        self.builder = backend.get_builder_cls()(spec, ["gdn"], config, torch.device("cpu"))
        self.kv_cache_config = KVCacheConfig(
            num_blocks=BLOCKS,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["gdn"], spec)],
        )
        self.attn_groups = [[AttentionGroup(backend, ["gdn"], spec, 0, [self.builder])]]
        self.input_batch = InputBatch()
        self.requests = requests  # vLLM's functions only read them: both worlds share them
        self.mamba_state_idx: dict[str, int] = {}
        self.device = torch.device("cpu")

        def make_buffer(*size, dtype):
            return CpuGpuBuffer(*size, dtype=dtype, device=self.device, pin_memory=False)

        self.num_accepted_tokens = make_buffer(REQUESTS, dtype=torch.int32)
        self._mamba_bufs = mamba_utils.MambaBuffers.create(
            REQUESTS, self.kv_cache_config, self.copy_funcs, make_buffer, self.device, True
        )

    def _get_mamba_bufs(self):
        return self._mamba_bufs

    @property
    def conv(self) -> torch.Tensor:
        return self.layer.kv_cache[0]

    @property
    def state(self) -> torch.Tensor:
        return self.layer.kv_cache[1]

    def whole(self) -> torch.Tensor:
        """bool [blocks]: ours holds a whole state there (written, not saved)."""
        written = ~torch.isnan(self.state).flatten(1).any(1)
        return written & ~self.builder.slot_record()


class Run:
    def __init__(self, seed: int):
        from vllm.v1.worker.gpu_input_batch import CachedRequestState

        self.cached_request_state = CachedRequestState
        self.rng = random.Random(seed)
        self.generator = torch.Generator().manual_seed(seed)
        self.mamba_utils = vllms_mamba_utils()
        geometry = PRESETS["tiny"].with_overrides(
            [
                f"linear_num_key_heads={HEADS}",
                f"linear_num_value_heads={V_HEADS}",
                f"linear_key_head_dim={DIM}",
                f"linear_value_head_dim={DIM}",
            ]
        )
        conv_shape = gdn_layer(geometry, vllm_config(DRAFTS)).get_state_shape()[0]
        shared = {
            "geometry": geometry,
            "A_log": self.rand(V_HEADS, scale=0.5),
            "dt_bias": self.rand(V_HEADS, scale=0.5),
            "conv": self.rand(BLOCKS, *conv_shape).to(torch.bfloat16),
        }
        self.requests: dict = {}
        self.ours = World(True, self.requests, shared, self.mamba_utils)
        self.vllms = World(False, self.requests, shared, self.mamba_utils)
        self.free_blocks = list(range(1, BLOCKS))
        self.kinds: set[str] = set()

    def rand(self, *shape, scale=1.0):
        return torch.randn(*shape, generator=self.generator) * scale

    def add(self, req_id: str, cached_from: str | None = None, cached_blocks: int = 0) -> None:
        """A new request; its first cached_blocks blocks a prefix-cache hit on another's."""
        blocks = self.requests[cached_from].block_ids[0][:cached_blocks] if cached_from else []
        own = [self.free_blocks.pop(0) for _ in range(COLUMNS - len(blocks))]
        self.requests[req_id] = self.cached_request_state(
            req_id=req_id, prompt_token_ids=[], mm_features=[], sampling_params=None,
            generator=None, block_ids=([*blocks, *own],), num_computed_tokens=cached_blocks * BLOCK,
            output_token_ids=[],
        )  # fmt: skip

    def scheduler_output(self, rows: list[tuple[str, int | None]]):
        from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

        scheduled = {req: WIDTH if prefill is None else prefill for req, prefill in rows}
        return SchedulerOutput(
            scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData.make_empty(),
            num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()),
            scheduled_spec_decode_tokens={r: [7] * DRAFTS for r, p in rows if p is None},
            scheduled_encoder_inputs={}, num_common_prefix_blocks=[0], finished_req_ids=set(),
            free_encoder_mm_hashes=[],
        )  # fmt: skip

    def step(self, rows: list[tuple[str, int | None]], kept: dict[str, int]) -> None:
        """rows in batch order, verifies first: (request, None) a verify of all drafts, (request,
        n) a prefill chunk of n tokens; kept: the accepted count of a verify (else random)."""
        from hyperqwen.engine import seams

        ids = [req for req, _ in rows]
        n = len(ids)
        output = self.scheduler_output(rows)
        for world in (self.ours, self.vllms):
            batch = world.input_batch
            previous = {r: batch.num_accepted_tokens_cpu[i] for i, r in enumerate(batch.req_ids)}
            batch.req_ids = ids
            for i, req in enumerate(ids):  # the batch condensed and reordered, counts kept
                batch.num_accepted_tokens_cpu[i] = previous.get(req, 1)
                batch.block_table[0].table[i] = torch.tensor(self.requests[req].block_ids[0])
        moved = self.expected_moves(ids, output)

        # the move: vLLM's preprocess_mamba, in ours between the seams
        for world in (self.ours, self.vllms):
            context = world.compilation_config.static_forward_context
            if world.replay:
                context = seams.runner_align_copies(world, output, "move", context)
            self.mamba_utils.preprocess_mamba(
                output, world.kv_cache_config, world.cache_config, world.mamba_state_idx,
                world.input_batch, self.requests, context, world.copy_funcs,
                world._mamba_bufs.preprocess,
            )  # fmt: skip
            if world.replay:
                seams.runner_align_copied(world, "move", n)
            counts = world.num_accepted_tokens
            counts.np[:n] = world.input_batch.num_accepted_tokens_cpu[:n]
            counts.copy_to_gpu(n)
        self.assert_same_decisions(n)
        self.assert_whole_states_match([dest for dest, _ in moved.values()])

        # the verify, and what a prefill chunk leaves
        ours, vllms = (self.metadata(world, rows) for world in (self.ours, self.vllms))
        self.verify(ours, vllms, rows)
        for req, prefill in rows:
            if prefill is not None:
                block = self.requests[req].block_ids[0][self.ours.mamba_state_idx[req]]
                fresh = self.rand(V_HEADS, DIM, DIM, scale=0.3)
                window = self.rand(*self.ours.conv.shape[1:]).to(torch.bfloat16)
                for world in (self.ours, self.vllms):
                    world.state[block], world.conv[block] = fresh, window

        # the boundary copy: vLLM's fused postprocess, in ours between the seams
        accepted = [kept.get(r, self.rng.randint(1, WIDTH)) if p is None else 1 for r, p in rows]
        copied = self.expected_boundary_copies(rows, accepted)
        for world in (self.ours, self.vllms):
            world.num_accepted_tokens.gpu[:n] = torch.tensor(accepted, dtype=torch.int32)
            bufs = world._mamba_bufs
            self.mamba_utils.stage_postprocess_inputs_to_gpu(
                bufs.postprocess_align, output, ids, n, self.requests, world.mamba_state_idx
            )
            context = world.compilation_config.static_forward_context
            if world.replay:
                context = seams.runner_align_copies(world, output, "boundary", context)
            self.mamba_utils.postprocess_mamba_align_gpu(
                bufs=bufs, num_reqs=n, num_accepted_tokens_gpu=world.num_accepted_tokens.gpu,
                num_accepted_tokens_cpu_tensor=world.input_batch.num_accepted_tokens_cpu_tensor,
                input_batch=world.input_batch, kv_cache_config=world.kv_cache_config,
                forward_context=context, mamba_state_copy_funcs=world.copy_funcs,
            )  # fmt: skip
            if world.replay:
                seams.runner_align_copied(world, "boundary", n)
        self.assert_same_decisions(n)
        self.assert_whole_states_match(copied)
        for (req, prefill), count in zip(rows, accepted, strict=True):
            self.requests[req].num_computed_tokens += count if prefill is None else prefill

    def expected_moves(self, ids: list[str], output) -> dict[str, tuple[int, int]]:
        """Per request preprocess_mamba moves: its new block and the saved tokens ours folds."""
        moves = {}
        saved = self.ours.builder.slot_record()
        for i, req in enumerate(ids):
            request = self.requests[req]
            computed = request.num_computed_tokens
            source = self.vllms.mamba_state_idx.get(req, (computed - 1) // BLOCK)
            dest = -(-(computed + output.num_scheduled_tokens[req]) // BLOCK) - 1
            if source in (-1, dest):
                continue
            blocks = request.block_ids[0]
            count = int(self.vllms.input_batch.num_accepted_tokens_cpu[i])
            count = count if saved[blocks[source]] else 0
            self.kinds.add(f"move, {'folding saved tokens' if count else 'a whole state'}")
            moves[req] = (blocks[dest], count)
        return moves

    def expected_boundary_copies(self, rows, accepted) -> list[int]:
        """The blocks vLLM's postprocess copies a boundary state to (what ours folds into)."""
        dests = []
        for (req, prefill), count in zip(rows, accepted, strict=True):
            computed = self.requests[req].num_computed_tokens
            drafts = 0 if prefill is not None else DRAFTS
            running = computed + (prefill or WIDTH) - drafts
            aligned = (running + count - 1) // BLOCK * BLOCK
            column, state_idx = aligned // BLOCK - 1, self.vllms.mamba_state_idx[req]
            if aligned < running or (column == state_idx and aligned == running):
                continue
            dests.append(self.requests[req].block_ids[0][column])
            where = "in place" if column == state_idx else "into an earlier block"
            self.kinds.add(f"boundary, {where}")
        return dests

    def metadata(self, world: World, rows):
        from vllm.v1.attention.backend import CommonAttentionMetadata

        n = len(rows)
        lens = [WIDTH if p is None else p for _, p in rows]
        starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        computed = [self.requests[r].num_computed_tokens for r, _ in rows]
        seq_lens = torch.tensor(computed, dtype=torch.int32) + torch.tensor(lens, dtype=torch.int32)
        common = CommonAttentionMetadata(
            query_start_loc=starts, query_start_loc_cpu=starts.clone(), seq_lens=seq_lens,
            num_reqs=n, num_actual_tokens=int(starts[-1]), max_query_len=max(lens),
            max_seq_len=int(seq_lens.max()),
            block_table_tensor=world.input_batch.block_table[0].get_device_tensor(n),
            slot_mapping=torch.zeros(int(starts[-1]), dtype=torch.int64),
            seq_lens_cpu_upper_bound=seq_lens.clone(),
        )  # fmt: skip
        drafts = torch.tensor([DRAFTS if p is None else -1 for _, p in rows], dtype=torch.int32)
        return world.builder.build(
            0, common, num_accepted_tokens=world.num_accepted_tokens.gpu[:n],
            num_decode_draft_tokens_cpu=drafts,
        )  # fmt: skip

    def verify(self, ours, vllms, rows) -> None:
        from hyperqwen.engine import seams

        total = sum(WIDTH if p is None else p for _, p in rows)
        a = self.rand(total, V_HEADS).to(torch.bfloat16)
        b = self.rand(total, V_HEADS).to(torch.bfloat16)
        spec_tokens = WIDTH * sum(p is None for _, p in rows)
        q, k = (self.rand(1, spec_tokens, HEADS, DIM).to(torch.bfloat16) for _ in range(2))
        v = self.rand(1, spec_tokens, V_HEADS, DIM).to(torch.bfloat16)
        layer = self.ours.layer
        seams.gdn_step_begins(layer, ours)
        out = seams.gdn_verify(layer, ours, q, k, v, a, b)
        if not spec_tokens:
            assert out is None
            return
        spec = vllms.num_spec_decodes
        v_out, _ = vllms_kernel()(
            A_log=layer.A_log, dt_bias=layer.dt_bias, q=q, k=k, v=v,
            a=a.index_select(0, vllms.spec_token_indx), b=b.index_select(0, vllms.spec_token_indx),
            cu_seqlens=vllms.spec_query_start_loc[: spec + 1], initial_state=self.vllms.state,
            inplace_final_state=True, use_qk_l2norm_in_kernel=True,
            ssm_state_indices=vllms.spec_state_indices_tensor,
            num_accepted_tokens=vllms.num_accepted_tokens,
        )  # fmt: skip
        assert torch.isfinite(out).all()
        assert torch.allclose(out[0].float(), v_out[0].float(), rtol=8e-3, atol=1e-3)

    def assert_same_decisions(self, n: int) -> None:
        assert self.ours.mamba_state_idx == self.vllms.mamba_state_idx
        ours, vllms = (w.input_batch.num_accepted_tokens_cpu[:n] for w in (self.ours, self.vllms))
        assert (ours == vllms).all()

    def assert_whole_states_match(self, copied_to: list[int]) -> None:
        whole = self.ours.whole()
        for block in copied_to:  # every state vLLM moved or copied is whole in ours
            assert whole[block], block
        blocks = whole.nonzero().flatten()
        ours, vllms = self.ours.state[blocks], self.vllms.state[blocks]
        assert torch.allclose(ours, vllms, rtol=1e-5, atol=1e-6)
        # vLLM's conv copies, in ours from the conv state alone
        assert torch.equal(self.ours.conv.view(torch.int16), self.vllms.conv.view(torch.int16))


def run_align_steps(run: Run) -> None:
    run.add("A")
    run.add("B")
    run.add("C")
    steps = [
        # prompts: A and B end on a block's boundary (in place, nothing to fold), C does not
        ([("A", 4), ("B", 4), ("C", 3)], {}),
        # first verifies, each after a move of a whole state; B all accepted: a boundary in
        # place, C one: the boundary into its first block
        ([("A", None), ("B", None), ("C", None)], {"A": 2, "B": WIDTH, "C": 1}),
        # A moves, folding 2 saved tokens, and its boundary state goes back into the block it
        # left, whose last verify was saved; B moves from the block cleared in place
        ([("A", None), ("B", None), ("C", None)], {"A": 3}),
        # D hits the cache on A's first two blocks: a move from the one A's boundary fold wrote
        ([("A", None), ("B", None), ("C", None), ("D", 2)], {}),
        ([("D", None), ("C", None), ("A", None), ("B", None)], {}),
        ([("B", None), ("D", None), ("A", None), ("C", None)], {}),
        ([("C", None), ("A", None), ("D", None), ("B", None)], {}),
    ]
    for number, (rows, kept) in enumerate(steps):
        if number == 3:
            run.add("D", cached_from="A", cached_blocks=2)
        run.step(rows, kept)


@pytest.mark.usefixtures("vllm_on_cpu")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the interpreter's, per scalar
def test_align_copies_through_the_seams_match_vllms_per_token_path(monkeypatch):
    from hyperqwen.engine.features import GDN_REPLAY

    monkeypatch.setenv(GDN_REPLAY.env, "1")
    run = Run(seed=11)
    run_align_steps(run)
    assert run.kinds == {
        "move, folding saved tokens",
        "move, a whole state",
        "boundary, in place",
        "boundary, into an earlier block",
    }
    # blocks no request owns: never written, states and saved inputs alike
    owned = {b for r in run.requests.values() for b in r.block_ids[0]}
    unused = torch.tensor([b not in owned for b in range(BLOCKS)])
    unused[0] = True
    for tensor in run.ours.layer.kv_cache[1:]:
        assert torch.isnan(tensor[unused].float()).all()

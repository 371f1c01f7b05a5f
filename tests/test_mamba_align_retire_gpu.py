"""mamba-align-retire.patch on a GPU: greedy answers to prompts prefilled in several chunks with
prefix caching (vLLM's mamba "align" mode, whose GDN state blocks the patch retires as the
chunks complete) against the same server without prefix caching, both drafting with MTP under
async scheduling (vLLM's default). The tiny synthetic checkpoint's random weights answer
deterministically, so a state block retired while still read would change the answers; where
the chunks differ the arithmetic runs in another order, so answers must agree up to a near tie
of the reference (as tests/test_engine_align_whole_prompt_gpu.py judges them).

Run on the GPU host: `pytest -m gpu tests/test_mamba_align_retire_gpu.py`.
"""

from __future__ import annotations

import random

import pytest
from gpu_server import agreeing_prefix
from test_engine_align_whole_prompt_gpu import TOKENS, answers_per_server
from test_prepare_gpu import MTP2, NEAR_TIE

pytestmark = pytest.mark.gpu

# a step's tokens: two of the tiny model's cache blocks (about 200 tokens each), so a prompt of
# 1,900 tokens is prefilled in about five chunks, each leaving a state block behind it
STEP_TOKENS = 512
rng = random.Random(1)
PROMPTS = {f"long{n}": [rng.randrange(1000, 20000) for _ in range(n)] for n in (1100, 1500, 1900)}
SERVERS = {"no-cache": "--no-enable-prefix-caching", "align": "--enable-prefix-caching"}


def test_chunked_prefills_answer_the_same_with_and_without_the_cache(tmp_path, tmp_path_factory):
    step = ["--max-num-batched-tokens", str(STEP_TOKENS)]
    servers = {name: ([caching, *step], {}) for name, caching in SERVERS.items()}
    results = answers_per_server(tmp_path, tmp_path_factory, servers, PROMPTS, MTP2,
                                 "align-retire")  # fmt: skip
    for name, answer in results["align"].items():
        assert len(answer["greedy_ids"]) == TOKENS
        agreed, at_near_tie = agreeing_prefix(results["no-cache"][name], answer, NEAR_TIE)
        assert at_near_tie, f"{name} differs at token {agreed}, not a near tie"

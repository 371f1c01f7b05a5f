#!/bin/bash
# Issue 25, decode deep in a long context (~25 min on an H100): stock vLLM with an fp8 cache
# against CTX=huge, C1, one cold (salted) prompt per depth, 256 tokens decoded after it.
#   depth240:       128k and 240k, stock fp8 against KV=fp8, both in 9 GiB (~250k tokens); the
#                   cold TTFT of depth131072 is issue 25's 128k one. On 2026-12-06 (H100) own
#                   fp8 was preempted 1 and 7 times there, prefix caching's align mode keeping a
#                   GDN state block per prefill chunk (docs/results/2026-12-06-h100-27b-
#                   depth240-fp8.json); mamba-align-retire.patch retires them since: this run
#                   says whether its preemptions are gone and what that does to its TTFT
#   depth240-kvarn: the same depths with KV=kvarn against the stock half depth240 saved (a
#                   third 27B server with a 9 GiB pool does not fit beside two on an 80 GB card)
# First (~1 min) KVarN's graph-safe metadata (a captured decode step replayed for the next
# ones against the eager forward; the build's copy and kernel queued, not waited for), and
# the decode kernel's two pipelines against float64; then (~5 min) prefix caching's answers
# against none with the series' align-mode patch.
# Then, alone on the GPU: the stock side of the fp8 capacity row, and the sizing tests.
# shellcheck source=bench/gpu-host/steps.sh
source bench/gpu-host/steps.sh depth || exit 1
step kvarn-graph python3 -m pytest -m gpu tests/test_kvarn_gpu.py \
  -k 'cuda_graph or queued or decode_at_27b'
# mamba-align-retire.patch's exactness: greedy answers with prefix caching against without it,
# prompts prefilled in several chunks with MTP drafting (the GDN state blocks the patch now
# retires as chunks complete), and the whole-prompt feature's check on the same series
step align-exact python3 -m pytest -m gpu tests/test_mamba_align_retire_gpu.py \
  tests/test_engine_align_whole_prompt_gpu.py
deep='--mode single --cohorts 1 --rounds 4 --prefill none --output-len 256 --temperature 0
  --seed 0 --synthetic-acceptance 0.77,0.55,0.4 --depths 131072,245760 --prefill-requests 1'
stock_240k='--kv-cache-dtype fp8 --max-model-len 250000 --max-num-seqs 1'
step depth240 env AB_KV_MEM=9G AB_STOCK_ARGS="$stock_240k" \
  bash bench/gpu-host/ab_together.sh depth240 "$deep" 'CTX=huge KV=fp8'
step depth240-kvarn env AB_KV_MEM=9G AB_STOCK_ARGS="$stock_240k" \
  AB_STOCK_HALF="$R/depth240/stock-half.json" \
  bash bench/gpu-host/ab_together.sh depth240-kvarn "$deep" 'CTX=huge KV=kvarn'
step tables python3 -m hyperqwen.cli bench table "$R"/depth240/v1.json \
  "$R"/depth240-kvarn/v1.json --labels fp8,kvarn --rows 'depth*' 'c1_*'
step capacity-fp8 python3 -m hyperqwen.cli bench capacity --kv fp8 \
  --stock-vllm "$HYPERQWEN_STOCK_VLLM" --patched-vllm "$HYPERQWEN_PATCHED_VLLM" \
  --work /tmp/capacity-work --out "$P/capacity-fp8.json"
step capacity-tests python3 -m pytest -m gpu tests/test_capacity_gpu.py \
  -k 'sized_to_a_24gb or gdn_replay'
# Last, KVarN's kernels alone (~3 min; published on 2026-12-06, so after the served rows),
# against FlashAttention over bf16 and fp8: decode's split sweep at a C1 verify block (what
# backend.decode_splits should pick), and an 8k chunk's prefill by dequantization beside the
# kernel at 32 rows
step kvarn-decode python3 -m hyperqwen.kvarn.bench --contexts 32768 114688 --batch 1 \
  --queries 4 --out "$P/kvarn-decode.json"
step kvarn-prefill python3 -m hyperqwen.kvarn.bench --prefill --contexts 32768 114688 \
  --chunks 8192 --rows 32 --out "$P/kvarn-prefill.json"

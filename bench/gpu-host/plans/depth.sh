#!/bin/bash
# Issue 25, decode deep in a long context (~30 min on an H100): stock vLLM with an fp8 cache
# against CTX=huge, C1, one cold (salted) prompt per depth, 256 tokens decoded after it.
#   depth240: 128k and 240k, stock fp8 against KV=fp8, both in 9 GiB (~250k tokens); the
#             cold TTFT of depth131072 is issue 25's 128k one. KVarN is left out: a third
#             server with a 9 GiB pool does not fit beside these two on an 80 GB card
#   short:    C1 at 128 tokens of context, stock fp8 against KV=fp8 and KV=kvarn, 32 profiled
#             steps a side: KVarN's short-context cost with its builds' device work as one
#             copy and one kernel (kvarn/step_tensors.py). The 32k/112k run before it
#             (docs/results/2026-12-06-h200-27b-depth-kvarn.json: 1.12-1.20x own fp8's TPOT)
#             profiled the same step at 10.29 GPU ms against fp8's 10.07, and 18.6 ms of host
#             CPU against 15.1: the cost is host work
#   ttft-machete: the 32k cold TTFT with vLLM's own int4 kernel choice (Machete on Hopper)
# First (~1 min) KVarN's graph-safe metadata (a captured decode step replayed for the next
# ones against the eager forward; the build's copy and kernel queued, not waited for), and
# the decode kernel's two pipelines against float64.
# Then, alone on the GPU: the stock side of the fp8 capacity row, and the sizing tests.
# shellcheck source=bench/gpu-host/steps.sh
source bench/gpu-host/steps.sh depth || exit 1
step kvarn-graph python3 -m pytest -m gpu tests/test_kvarn_gpu.py \
  -k 'cuda_graph or queued or decode_at_27b'
deep='--mode single --cohorts 1 --rounds 4 --prefill none --output-len 256 --temperature 0
  --seed 0 --synthetic-acceptance 0.77,0.55,0.4'
step short env AB_KV_MEM=5G AB_GPU_UTIL=0.31 \
  AB_STOCK_ARGS='--kv-cache-dtype fp8 --max-model-len 120000 --max-num-seqs 1' \
  bash bench/gpu-host/ab_together.sh short "$deep --profile-steps 32" \
  'CTX=huge KV=fp8' 'CTX=huge KV=kvarn'
# where the host's step goes, stock against each cache (py-spy's stacks, bench/README.md)
step hoststacks-fp8 python3 -m hyperqwen.cli bench hoststacks "$R"/short/v1.json --top 40
step hoststacks-kvarn python3 -m hyperqwen.cli bench hoststacks "$R"/short/v2.json --top 40
step depth240 env AB_KV_MEM=9G \
  AB_STOCK_ARGS='--kv-cache-dtype fp8 --max-model-len 250000 --max-num-seqs 1' \
  bash bench/gpu-host/ab_together.sh depth240 "$deep --depths 131072,245760 --prefill-requests 1" \
  'CTX=huge KV=fp8'
# What of own fp8's cold TTFT above stock's (1.6x at 32k and 112k on 2026-12-06) is the int4
# GEMMs: the single profile runs Marlin, Hopper's stock Machete; this variant takes vLLM's
# choice (the rest would be CTX=huge's 4,096-token chunks against stock's 8,192)
step ttft-machete env AB_KV_MEM=5G AB_GPU_UTIL=0.31 \
  AB_STOCK_ARGS='--kv-cache-dtype fp8 --max-model-len 120000 --max-num-seqs 1' \
  bash bench/gpu-host/ab_together.sh ttft-machete "$deep --depths 32768 --prefill-requests 1" \
  'CTX=huge KV=fp8 LINEAR_BACKEND=auto'
step tables python3 -m hyperqwen.cli bench table "$R"/depth240/v1.json "$R"/short/v1.json \
  "$R"/short/v2.json --labels fp8-240,fp8,kvarn --rows 'depth*' 'c1_*' 'step_*'
step capacity-fp8 python3 -m hyperqwen.cli bench capacity --kv fp8 \
  --stock-vllm "$HYPERQWEN_STOCK_VLLM" --patched-vllm "$HYPERQWEN_PATCHED_VLLM" \
  --work /tmp/capacity-work --out "$P/capacity-fp8.json"
step capacity-tests python3 -m pytest -m gpu tests/test_capacity_gpu.py \
  -k 'sized_to_a_24gb or gdn_replay'
# Last, KVarN's kernels alone (~3 min; published on 2026-12-06, so after the served rows),
# against FlashAttention over bf16 and fp8: decode's split sweep at a C1 verify block (what backend.decode_splits should pick), and an 8k chunk's
# prefill by dequantization beside the kernel at 32 rows
step kvarn-decode python3 -m hyperqwen.kvarn.bench --contexts 32768 114688 --batch 1 \
  --queries 4 --out "$P/kvarn-decode.json"
step kvarn-prefill python3 -m hyperqwen.kvarn.bench --prefill --contexts 32768 114688 \
  --chunks 8192 --rows 32 --out "$P/kvarn-prefill.json"

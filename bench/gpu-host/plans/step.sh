#!/bin/bash
# Issue 27, the served C1 step (~25 min on an H100): what the host does per step, and the
# GPU-side knobs by the step map's GPU rows (a GPU knob cannot show in TPOT while the step is
# host-bound). Two ab_together runs of three 27B servers each (an 80 GB card holds three at a
# 4 GiB pool); the second takes the first's stock half, so its three servers are all patched.
#   feat: stock, LOOKUP=0, and every GPU-side knob at once (each moves its own kernel class:
#         INDUCTOR_PDL the norms and activations, GDN_BA and DRAFT_HEAD_INT8 dense_gemm's ba
#         GEMMs and draft head, GDN_RECURRENT gdn)
#   host: LOOKUP=0 again (a twin: the server-to-server spread, which a TPOT difference must
#         beat), MODEL_RUNNER=v2 (vLLM's runner that prepares a step on the GPU), and the
#         profile's defaults (quoting on: what it costs chat)
# Before them, with the GPU to itself, the draft-head kernel's exactness and timing (the feat
# run serves it). After them, each profiled side's trace mapped kernel by kernel, and the tables.
# shellcheck source=bench/gpu-host/steps.sh
source bench/gpu-host/steps.sh step || exit 1
c1="$c1_single --profile-steps 20"
# Each profiled side's trace of run NAME (bench ab keeps it in its workdir), mapped by `bench
# stepmap` (per-GEMM bytes and bandwidth, the idle time inside the step, the host thread's
# window) into $P/stepmap-NAME-SERVER-SIDE.json.
stepmaps() {
  local trace side server model
  for trace in /tmp/ab-together-"$1"/*/*-trace/*.pt.trace.json*; do
    side=$(basename "$(dirname "$trace")")
    side=${side%-trace}
    server=$(basename "$(dirname "$(dirname "$trace")")")
    model=/tmp/q27-prepared
    [ "$side" = stock ] && model=/tmp/q27
    python3 -m hyperqwen.cli bench stepmap --trace "$trace" --model-dir "$model" \
      --out "$P/stepmap-$1-$server-$side.json"
  done
}
step draft-argmax-test python3 -m pytest -m gpu -x tests/test_kernel_draft_argmax_gpu.py
step draft-head python3 -m hyperqwen.cli bench draft-head --out "$P/draft-head.json"
step feat env AB_KV_MEM=4G AB_STOCK_ARGS="$stock_length" bash bench/gpu-host/ab_together.sh feat "$c1" 'LOOKUP=0' \
  'INDUCTOR_PDL=1 GDN_BA=1 GDN_RECURRENT=1 DRAFT_HEAD_INT8=1 LOOKUP=0'
step host env AB_KV_MEM=4G AB_STOCK_ARGS="$stock_length" AB_STOCK_HALF="$R/feat/stock-half.json" \
  bash bench/gpu-host/ab_together.sh host "$c1" 'LOOKUP=0' 'MODEL_RUNNER=v2' ''
step tables python3 -m hyperqwen.cli bench table "$R"/feat/v1.json "$R"/feat/v2.json \
  "$R"/host/v1.json "$R"/host/v2.json "$R"/host/v3.json --labels lookup0,knobs,twin,v2,defaults
# where each side's host CPU goes, function by function (py-spy's stacks, bench/README.md):
# stock against LOOKUP=0 and against the profile's defaults (quoting on)
step hoststacks-feat python3 -m hyperqwen.cli bench hoststacks "$R"/feat/v1.json --top 40
step hoststacks-defaults python3 -m hyperqwen.cli bench hoststacks "$R"/host/v3.json --top 40
step stepmaps-feat stepmaps feat
step stepmaps-host stepmaps host
# GDN replay's step: 15 slots without and with GDN_REPLAY=1, profiled (its verify and fold kernels
# took a chat step from 12.9 to 29.5 ms across two runs: engine/quoting.md, "What is built";
# HQ_STEPS=replay,stepmaps-replay alone, ~10 min)
step replay env AB_KV_MEM=4G AB_STOCK_ARGS="$stock_length" bash bench/gpu-host/ab_together.sh \
  replay "$c1 --synthetic-acceptance-rest 0" 'DRAFT_TOKENS=15' 'DRAFT_TOKENS=15 GDN_REPLAY=1'
step stepmaps-replay stepmaps replay
step step-knobs-test python3 -m pytest -m gpu -x tests/test_step_knobs_gpu.py
step gdn-kernels-test python3 -m pytest -m gpu -x tests/test_gdn_kernels_gpu.py
step draft-vocab-test python3 -m pytest -m gpu tests/test_engine_draft_vocab_gpu.py

#!/bin/bash
# Sourced by a plan in bench/gpu-host/plans/ (`source bench/gpu-host/steps.sh PLAN`): the kit's
# environment (env.sh), $P=$R/PLAN for the plan's own outputs, and `step NAME COMMAND...`, which
# runs COMMAND with its output in $P/NAME.log, adds "NAME rc=N Ss" to $P/steps.txt and goes on
# whatever the status: a plan's steps are ordered by what they decide, and the device budget may
# end a plan anywhere, so every step that finished has its record.
# HQ_PLAN_CHECK=1 runs nothing and needs no kit: each command a step would run (for a step
# that is a plan's function: each `python3` and `env` command the function runs) prints the
# step's name, its word count and its words, NUL-separated, for tests/test_gpu_plans.py to check
# every option against the CLI's own parser and every test selection against pytest's before a
# GPU minute is spent on a typo.
# HQ_STEPS=a,b runs only the steps so named (the others are recorded as "NAME skipped"): a
# short device budget spends itself on the steps that decide most.
plan=$1
# The plans' C1 comparison on the 27B geometry (`bench ab` options: MTP's synthetic acceptance)
# and stock's length beside it: vLLM's default, the model's 262,144 tokens, needs 17.6 GiB of
# bf16 cache, more than the pool (the patched sides are sized to theirs by the launcher)
# shellcheck disable=SC2034 # read by the plans that source this file
c1_single='--mode single --input-len 128 --output-len 512 --cohorts 1 --rounds 16 --prefill none
  --temperature 0 --seed 0 --synthetic-acceptance 0.77,0.55,0.4'
# shellcheck disable=SC2034
stock_length='--max-model-len 32768'
if [ "${HQ_PLAN_CHECK:-0}" = 1 ]; then
  export R=${R:-/tmp/hq}
  export P=$R/$plan HYPERQWEN_STOCK_VLLM=/tmp/gpu-kit/vllm-stock \
    HYPERQWEN_PATCHED_VLLM=/tmp/gpu-kit/vllm-patched
  checked_step=
  record() {
    printf '%s\0%s\0' "$checked_step" "$#"
    printf '%s\0' "$@"
  }
  python3() { record python3 "$@"; }
  env() { record env "$@"; }
  step() {
    checked_step=$1
    shift
    if declare -F "$1" > /dev/null; then "$@"; else record "$@"; fi
    return 0
  }
  return 0
fi
# shellcheck source=bench/gpu-host/env.sh
source bench/gpu-host/env.sh || return 1
export P=$R/$plan
mkdir -p "$P"
step() {
  local name=$1 start status
  shift
  if [ -n "${HQ_STEPS:-}" ] && [[ ",$HQ_STEPS," != *",$name,"* ]]; then
    echo "$name skipped" | tee -a "$P/steps.txt"
    return 0
  fi
  start=$(date +%s)
  echo "$(date +%T) step $name: $*"
  "$@" > "$P/$name.log" 2>&1
  status=$?
  echo "$name rc=$status $(($(date +%s) - start))s" | tee -a "$P/steps.txt"
  tail -n "${TAILN:-5}" "$P/$name.log"
}

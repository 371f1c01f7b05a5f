#!/bin/bash
# bench/gpu-host/ab_together.sh NAME 'AB_OPTIONS' [VARIANT ...]: `hyperqwen bench ab` on the 27B
# geometry (dummy weights; the prepared model against its base) with the stock half and one
# patched run per VARIANT (the profile's knobs as NAME=VALUE words, '' for its defaults) started
# together under one --turn-lock, so one cold start is paid for all; they measure one at a time.
# Each pool is fixed (AB_KV_MEM, default 16G) and each server gets AB_GPU_UTIL (default 0.9
# shared out); AB_STOCK_ARGS adds vLLM flags to the stock side (e.g. --kv-cache-dtype fp8),
# AB_STOCK_ENV variables as NAME=VALUE words (e.g. VLLM_USE_V2_MODEL_RUNNER=1; variants.txt
# records them, the stock result does not). AB_STOCK_HALF=FILE takes the stock half an earlier run
# saved ($R/NAME/stock-half.json, measured with the same AB_OPTIONS) instead of serving stock
# again: one more patched variant fits the GPU, and its ratios are against that earlier run.
# AB_OPTIONS are the comparison's options (mode, cohorts, rounds, acceptance ...), the same
# for every run. A variant word TREE=DIR serves that variant from another checkout (DIR holds its
# src/ and patches/, e.g. `git archive COMMIT src patches`): its patches on a copy of the stock
# vLLM (made once, DIR/vllm-patched) and its src/ first on the server's path (its plugin, where
# it has one); this checkout's `bench ab` still drives it, with this launcher's argv and env.
# Results and logs in $R/NAME/ (vN.json is the Nth variant's result, variants.txt names them).
# Where no variant is measured (each refused or failed), the stock half is stopped, its server too.
# Detached, from the repository root on the kit's host:
#   bash bench/gpu-host/bg.sh NAME bash bench/gpu-host/ab_together.sh NAME 'OPTIONS' '' 'KNOB=1'
# shellcheck disable=SC1091
source bench/gpu-host/env.sh || exit 1
name=$1
options=$2
shift 2
out=$R/$name
work=/tmp/ab-together-$name
# A rerun keeps each server's compile cache (minutes of a cold start) and nothing else.
find "$work" -mindepth 1 -maxdepth 2 -type f -delete 2> /dev/null
rm -rf "$work/turn"*
mkdir -p "$out" "$work"
rm -f "$out/variants.txt"
kv=${AB_KV_MEM:-16G}
if [ -n "${AB_STOCK_HALF:-}" ]; then # the saved half, with its flags: its options must be these
  cp "$AB_STOCK_HALF" "$work/stock.json" || exit 1
  util=${AB_GPU_UTIL:-$(python3 -c "print(f'{0.9 / $#:.2f}')")}
  stock_args=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["plan"]["stock_args"])' \
    "$AB_STOCK_HALF") || exit 1
else
  util=${AB_GPU_UTIL:-$(python3 -c "print(f'{0.9 / ($# + 1):.2f}')")}
  stock_args="--gpu-memory-utilization $util --kv-cache-memory-bytes $kv ${AB_STOCK_ARGS:-}"
fi
model=${AB_MODEL:-/tmp/q27-prepared} # AB_MODEL and AB_STOCK_MODEL: other model folders
base=${AB_STOCK_MODEL:-/tmp/q27}
if [ -z "${AB_MODEL:-}" ]; then # made once per host: a later run on it reuses them
  [ -f "$base/config.json" ] ||
    python3 -m hyperqwen.cli synth "$base" --preset 27b --config-only > /dev/null || exit 1
  [ -f "$model/config.json" ] || python3 -m hyperqwen.cli synth "$model" --preset 27b \
    --config-only --prepared --draft-head > /dev/null || exit 1
fi
# TREE=DIR's patched vLLM: the stock tree with DIR's series applied, made once per host.
tree_vllm() {
  patched_vllm_copy "$1/vllm-patched" "$1/patches" "$1/patch.log" && echo "$1/vllm-patched"
}
# This checkout's CLI whatever PYTHONPATH says (a TREE variant's path puts its own src/ first).
this_checkout_cli='import sys; sys.path.insert(0, sys.argv.pop(1)); from hyperqwen.cli import main
sys.exit(main(sys.argv[1:]))'
triton_prefill='{"gdn_prefill_backend":"triton"}' # the GDN prefill 3090/4090 cards run
words=()
eval "words=($options)" # the options as a shell would split them, quotes kept
common=("$model" --stock-model "$base" --stock-vllm "$HYPERQWEN_STOCK_VLLM"
  --patched-vllm "$HYPERQWEN_PATCHED_VLLM" --state "$work/stock.json" --turn-lock "$work/turn"
  "--vllm-args=--load-format dummy --language-model-only --additional-config '$triton_prefill'"
  "--stock-args=$stock_args"
  "${words[@]}")
for variant in "$@"; do # every TREE's vLLM before any server starts
  for word in $variant; do
    [[ "$word" != TREE=* ]] || tree_vllm "${word#TREE=}" > /dev/null || exit 1
  done
done
bash bench/gpu-host/host_state.sh "$out/host-state-start.txt"
read -ra stock_env <<< "${AB_STOCK_ENV:-}"
stock_run=
if [ -n "${AB_STOCK_HALF:-}" ]; then
  echo "stock: the half saved in $AB_STOCK_HALF" >> "$out/variants.txt"
else
  echo "stock: env ${AB_STOCK_ENV:-(none)}; flags ${AB_STOCK_ARGS:-(none)}" >> "$out/variants.txt"
  env VLLM_CACHE_ROOT="$work/stock/cache" "${stock_env[@]}" python3 -m hyperqwen.cli bench ab \
    "${common[@]}" --phase stock --workdir "$work/stock" > "$out/stock.log" 2>&1 &
  stock_run=$!
fi
index=0
variant_runs=()
for variant in "$@"; do
  index=$((index + 1))
  echo "v$index: ${variant:-the profile defaults}" >> "$out/variants.txt"
  read -ra variant_words <<< "$variant"
  knobs=()
  tree_args=()
  for word in "${variant_words[@]}"; do
    if [[ "$word" != TREE=* ]]; then
      knobs+=("$word")
      continue
    fi
    tree=${word#TREE=}
    knobs+=(HYPERQWEN_PATCHES_DIR="$tree/patches" PYTHONPATH="$R/site:$tree/src:$KIT_PYTHONPATH")
    tree_args=(--patched-vllm "$(tree_vllm "$tree")")
  done
  env GPU_UTIL="$util" KV_MEM="$kv" VLLM_CACHE_ROOT="$work/v$index/cache" \
    "${knobs[@]}" python3 -c "$this_checkout_cli" "$PWD/src" \
    bench ab "${common[@]}" "${tree_args[@]}" --phase patched --workdir "$work/v$index" \
    --out "$out/v$index.json" > "$out/v$index.log" 2>&1 &
  variant_runs+=($!)
done
# Each run's logs (its servers' too) into $out as RUN-LOG: once a minute and at the end, so a run
# cut short (the device time spent) still brings back where its servers' starts went.
copy_logs() {
  local run log
  for run in "$work"/*/; do
    for log in "$run"*.log; do
      [ -f "$log" ] && cp "$log" "$out/$(basename "$run")-$(basename "$log")"
    done
  done
}
# While they run, once a minute: what each process takes of the host. The servers waiting for
# their turn still run their processes, and a C1 step is as much host work as GPU work.
while sleep 60; do
  bash bench/gpu-host/host_state.sh "$work/host-state-now.txt" && cat "$work/host-state-now.txt"
  copy_logs
done >> "$out/host-state-during.txt" 2>&1 &
sampler=$!
status=0
measured=0
for job in "${variant_runs[@]}"; do
  if wait "$job"; then measured=1; else status=1; fi
done
# No variant measured (each refused or failed): the stock half alone compares nothing, so it
# stops now rather than after its minutes of start and rows (bench ab stops its server on TERM).
if [ "$measured" = 0 ] && [ -n "${stock_run:-}" ] && kill -0 "$stock_run" 2> /dev/null; then
  echo "stock: stopped, as no variant was measured" >> "$out/variants.txt"
  kill -TERM "$stock_run"
fi
[ -z "${stock_run:-}" ] || wait "$stock_run" || status=1
kill "$sampler" 2> /dev/null
bash bench/gpu-host/host_state.sh "$out/host-state-end.txt"
# the stock half this run measured, for a later run's AB_STOCK_HALF
[ -z "${AB_STOCK_HALF:-}" ] && [ -f "$work/stock.json" ] && cp "$work/stock.json" "$out/stock-half.json"
copy_logs
exit $status

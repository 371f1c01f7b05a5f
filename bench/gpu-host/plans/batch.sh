#!/bin/bash
# Issue 26, batch throughput (~50 min on an H100: two sessions; its steps stand alone). The
# batch profile holds ~300 requests of 640 tokens on an 80 GB card (`hyperqwen capacity --mode
# batch --card-gib 79.2`), stock's C256 needs the whole card too: one server at a time.
#   kernels-mlp: the MLP pair's W4A16 and W4A8 kernels at M = 1-256, humming's among them
#   batch:       stock against the batch profile at C1/C64/C256 and prefill 1k/8k/32k, each side
#                profiling a C64 step (the step is neither bandwidth- nor launch-bound by
#                arithmetic; the profile says which)
#   v2, state-fp16, no-prefix-cache, whole-prompt: one knob each against the same stock half
# shellcheck source=bench/gpu-host/steps.sh
source bench/gpu-host/steps.sh batch || exit 1
triton_prefill='{"gdn_prefill_backend":"triton"}' # the GDN prefill 3090/4090 cards run
comparison=(/tmp/q27-prepared --stock-model /tmp/q27 --mode batch
  --stock-vllm "$HYPERQWEN_STOCK_VLLM" --patched-vllm "$HYPERQWEN_PATCHED_VLLM"
  --input-len 128 --output-len 512 --cohorts '1,64,256' --rounds 3 --prefill '1024,8192,32768'
  --prefill-requests 3 --temperature 0 --seed 0 --profile-steps 10 --profile-cohort 64
  "--vllm-args=--load-format dummy --language-model-only --additional-config '$triton_prefill'"
  --state /tmp/batch/ab-state.json)
models() {
  [ -f /tmp/q27/config.json ] || python3 -m hyperqwen.cli synth /tmp/q27 --preset 27b --config-only
  [ -f /tmp/q27-prepared/config.json ] || python3 -m hyperqwen.cli synth /tmp/q27-prepared \
    --preset 27b --config-only --prepared --draft-head
}
# The patched side alone with these knobs, against the stock half the batch step saved.
variant() {
  local name=$1
  shift
  env "$@" python3 -m hyperqwen.cli bench ab "${comparison[@]}" --phase patched \
    --workdir "/tmp/batch-$name" --out "$P/batch-$name.json"
}
step kernels-mlp python3 -m hyperqwen.cli bench kernels --only mlp --m 1 2 4 8 16 32 64 128 256 \
  --backends machete marlin humming w4a8_marlin_int8 w4a8_cutlass_fp8 w4a8_humming_int8 \
  w4a8_humming_fp8 --out "$P/kernels-mlp.json"
step models models
step batch python3 -m hyperqwen.cli bench ab "${comparison[@]}" --workdir /tmp/batch \
  --out "$P/batch.json"
step v2 variant v2 MODEL_RUNNER=v2
step state-fp16 variant state-fp16 STATE_DTYPE=float16
step no-prefix-cache variant no-prefix-cache PREFIX_CACHE=0
step whole-prompt variant whole-prompt PREFIX_CACHE_WHOLE_PROMPT=1

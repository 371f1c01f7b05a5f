#!/bin/bash
# bench/gpu-host/host_state.sh FILE: what else the host is doing, for reading a measurement
# beside it: CPU model and count, load, the busiest processes, the GPU's clocks, throttle
# reasons and compute processes. A C1 step of the single profile is as much host work as GPU
# work, so a busy or slower CPU shows in it.
{
  date --iso-8601=seconds
  lscpu | grep -E '^(Model name|CPU\(s\)|Thread|Core|Socket|CPU max MHz)'
  uptime
  ps -eo pid,pcpu,pmem,etime,args --sort=-pcpu | head -12 | cut -c1-160
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,clocks.max.sm,temperature.gpu,power.draw,utilization.gpu,memory.used \
    --format=csv
  nvidia-smi -q -d PERFORMANCE | grep -E 'Active|Slowdown|Throttle' | grep -v 'Not Active' | head -12
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv
} > "$1" 2>&1

#!/bin/bash
# The cluster-up 1P2D layout (decode workers pinned to a CPU each, the prefill worker unpinned
# at nice 5), threshold and cost placement, with the interactive step target on (250, the
# default) and off (0), one after the other.
set -u
cd /work/main
for T in 250 0; do
  L=$([ $T = 0 ] && echo off || echo on)
  .venv/bin/python -m bench.sim.real --out docs/bench/interactive_step_s61/goodput_1p2d/$L \
    --log-dir /tmp/s61/gp_logs_$L --systems threshold,cost --rates 0.2,0.45,0.8,1.2 \
    --workload mixed-cpu --num-requests 30 --calibrate 2 --ttft-slo-ms 1000 --tpot-slo-ms 125 \
    --class-slo batch:15000:125 --interactive-step-target-ms $T --quiet
done

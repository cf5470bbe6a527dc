#!/bin/bash
# The simulator's same-session inputs on this Intel Xeon guest (as ../placement_s74/validate.sh),
# at 1be9bad (a worktree at /tmp/s75/wt5), after measure.sh; its 1P2D records are
# measure.sh's (real_1p2d_xeon_adapt, prefill_probe_1p2d_xeon_adapt, made at 1be9bad too).
set -u
export PYTHONPATH=/tmp/s75/wt5
PY=/work/main/.venv/bin/python
cd /tmp/s75/wt5
O=/tmp/s75/rec5
mkdir -p $O /tmp/s75/logs
step() { echo "$1 start $(date +%T)"; }
step profile; taskset -c 1 $PY -m bench.engine_profile --threads 1 --out $O/engine_profile_xeon_1be9bad.json > /tmp/s75/profile.out 2>&1
step corun; taskset -c 1 $PY -m bench.engine_profile --corun 0 --rounds 3 --out $O/engine_corun_xeon_1be9bad.json > /tmp/s75/corun.out 2>&1
step streaming; $PY -m bench.sim.real streaming --out $O/streaming_1p1d_xeon > /tmp/s75/streaming.out 2>&1
step probe1; $PY -m bench.sim.real prefill --out $O/prefill_probe_1p1d_xeon --layout 1p1d --concurrency 0,2,4,8 --probes 4 > /tmp/s75/probe1.out 2>&1
step real1; $PY -m bench.goodput --out $O/real_1p1d_xeon --log-dir /tmp/s75/logs/1p1d \
  --systems disaggregated,disaggregated-cost --rates 0.2,0.45,0.8,1.2 --workload mixed-cpu \
  --num-requests 48 --calibrate 2 --ttft-slo-ms 1000 --tpot-slo-ms 125 \
  --class-slo batch:15000:125 --quiet > /tmp/s75/real1.out 2>&1
step done

#!/bin/bash
# Same-session calibration and real sweeps for the simulator's validation (stop 74, AMD Zen 4),
# as stop 73's ../placement_s73/validate.sh, at c3d7015 (a worktree at /tmp/s74/wt); the
# records were made under /tmp/s74/rec and copied here.
set -u
export PYTHONPATH=/tmp/s74/wt
PY=/work/main/.venv/bin/python
cd /tmp/s74/wt
O=/tmp/s74/rec
mkdir -p $O /tmp/s74/logs
step() { echo "$1 start $(date +%T)"; }
step profile; taskset -c 1 $PY -m bench.engine_profile --threads 1 --out $O/engine_profile_zen4_c3d7015.json > /tmp/s74/profile.out 2>&1
step corun; taskset -c 1 $PY -m bench.engine_profile --corun 0 --rounds 3 --out $O/engine_corun_zen4_c3d7015.json > /tmp/s74/corun.out 2>&1
step streaming; $PY -m bench.sim.real streaming --out $O/streaming_1p1d_zen4 > /tmp/s74/streaming.out 2>&1
step probe1; $PY -m bench.sim.real prefill --out $O/prefill_probe_1p1d_zen4 --layout 1p1d --concurrency 0,2,4,8 --probes 4 > /tmp/s74/probe1.out 2>&1
step probe2; $PY -m bench.sim.real prefill --out $O/prefill_probe_1p2d_zen4 --layout 1p2d --concurrency 0,2,4,8 --probes 4 > /tmp/s74/probe2.out 2>&1
step real1; $PY -m bench.goodput --out $O/real_1p1d_zen4 --log-dir /tmp/s74/logs/1p1d \
  --systems disaggregated,disaggregated-cost --rates 0.2,0.45,0.8,1.2 --workload mixed-cpu \
  --num-requests 48 --calibrate 2 --ttft-slo-ms 1000 --tpot-slo-ms 125 \
  --class-slo batch:15000:125 --quiet > /tmp/s74/real1.out 2>&1
step real2; $PY -m bench.sim.real --out $O/real_1p2d_zen4 --log-dir /tmp/s74/logs/1p2d \
  --systems threshold,cost --rates 0.2,0.45,0.8,1.2 --workload mixed-cpu --num-requests 48 \
  --calibrate 2 --ttft-slo-ms 1000 --tpot-slo-ms 125 --class-slo batch:15000:125 --quiet > /tmp/s74/real2.out 2>&1
step done

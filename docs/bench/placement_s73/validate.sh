#!/bin/bash
# Same-session calibration and real sweeps for the simulator's validation (stop 73, AMD Zen 5),
# as stop 72's ../placement_s72/validate.sh, at 2bd798a (a worktree at /tmp/s73/wt); the
# records were made under /tmp/s73/rec and copied here.
set -u
export PYTHONPATH=/tmp/s73/wt
PY=/work/main/.venv/bin/python
cd /tmp/s73/wt
O=/tmp/s73/rec
mkdir -p $O /tmp/s73/logs
step() { echo "$1 start $(date +%T)"; }
step profile; taskset -c 1 $PY -m bench.engine_profile --threads 1 --out $O/engine_profile_zen5_2bd798a.json > /tmp/s73/profile.out 2>&1
step corun; taskset -c 1 $PY -m bench.engine_profile --corun 0 --rounds 3 --out $O/engine_corun_zen5_2bd798a.json > /tmp/s73/corun.out 2>&1
step streaming; $PY -m bench.sim.real streaming --out $O/streaming_1p1d_zen5 > /tmp/s73/streaming.out 2>&1
step probe1; $PY -m bench.sim.real prefill --out $O/prefill_probe_1p1d_zen5 --layout 1p1d --concurrency 0,2,4,8 --probes 4 > /tmp/s73/probe1.out 2>&1
step probe2; $PY -m bench.sim.real prefill --out $O/prefill_probe_1p2d_zen5 --layout 1p2d --concurrency 0,2,4,8 --probes 4 > /tmp/s73/probe2.out 2>&1
step real1; $PY -m bench.goodput --out $O/real_1p1d_zen5 --log-dir /tmp/s73/logs/1p1d \
  --systems disaggregated,disaggregated-cost --rates 0.2,0.45,0.8,1.2 --workload mixed-cpu \
  --num-requests 48 --calibrate 2 --ttft-slo-ms 1000 --tpot-slo-ms 125 \
  --class-slo batch:15000:125 --quiet > /tmp/s73/real1.out 2>&1
step real2; $PY -m bench.sim.real --out $O/real_1p2d_zen5 --log-dir /tmp/s73/logs/1p2d \
  --systems threshold,cost --rates 0.2,0.45,0.8,1.2 --workload mixed-cpu --num-requests 48 \
  --calibrate 2 --ttft-slo-ms 1000 --tpot-slo-ms 125 --class-slo batch:15000:125 --quiet > /tmp/s73/real2.out 2>&1
step done

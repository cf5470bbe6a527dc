#!/bin/bash
# Stop 77 (a 2-vCPU Intel Xeon guest, family 6 model 207: Emerald Rapids): a record set the
# simulator's new way of sharing the cores was not fitted on. From a worktree at 0611504
# (/tmp/s77/wt; the cluster's code as it is at the commit that changed only the
# simulator): the simulator's same-session engine-level inputs (as ../placement_s76/measure.sh
# after), then `pdserve cluster up --prefill 1 --decode 2` as bench.sim.real runs it,
# prefill probes and a sweep. One after the other in one session; records in /tmp/s77/rec.
set -u
PY=/work/main/.venv/bin/python
T=/tmp/s77/wt
O=/tmp/s77/rec
L=/tmp/s77/logs
mkdir -p $O $L
step() { echo "$1 start $(date +%T)"; }
cd $T
export PYTHONPATH=$T
step profile; taskset -c 1 $PY -m bench.engine_profile --threads 1 --out $O/engine_profile_emr_0611504.json > $L/profile.out 2>&1
step corun; taskset -c 1 $PY -m bench.engine_profile --corun 0 --rounds 3 --out $O/engine_corun_emr_0611504.json > $L/corun.out 2>&1
step streaming; $PY -m bench.sim.real streaming --out $O/streaming_1p1d_emr > $L/streaming.out 2>&1
step probe1; $PY -m bench.sim.real prefill --out $O/prefill_probe_1p1d_emr --layout 1p1d --concurrency 0,2,4,8 --probes 4 > $L/probe1.out 2>&1
step probe2; $PY -m bench.sim.real prefill --out $O/prefill_probe_1p2d_emr --layout 1p2d --concurrency 0,2,4,8 --probes 4 > $L/probe2.out 2>&1
step real2; $PY -m bench.sim.real --out $O/real_1p2d_emr --log-dir $L/1p2d --systems threshold,cost \
  --rates 0.2,0.45,0.8,1.2 --workload mixed-cpu --num-requests 48 --calibrate 2 \
  --ttft-slo-ms 1000 --tpot-slo-ms 125 --class-slo batch:15000:125 --quiet > $L/real2.out 2>&1
step done

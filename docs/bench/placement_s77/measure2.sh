#!/bin/bash
# Stop 77, after measure.sh in the same session and worktree (/tmp/s77/wt at 0611504): the
# router harness at 64 and 256 emulated workers with the compiled data plane (stop 74's
# command: ../dataplane_s68/harness.sh; records in ../dataplane_s77), then the 1P1D sweep
# the simulator replays beside the 1P2D one (as ../placement_s76/measure.sh's real1).
set -u
PY=/work/main/.venv/bin/python
T=/tmp/s77/wt
O=/tmp/s77/rec
L=/tmp/s77/logs
mkdir -p $O/harness $L
step() { echo "$1 start $(date +%T)"; }
step harness64; O=$O/harness bash $T/docs/bench/dataplane_s68/harness.sh 64 cost:compiled
step harness256; O=$O/harness bash $T/docs/bench/dataplane_s68/harness.sh 256 cost:compiled
step real1; (cd $T && PYTHONPATH=$T $PY -m bench.goodput --out $O/real_1p1d_emr --log-dir $L/1p1d \
  --systems disaggregated,disaggregated-cost --rates 0.2,0.45,0.8,1.2 --workload mixed-cpu \
  --num-requests 48 --calibrate 2 --ttft-slo-ms 1000 --tpot-slo-ms 125 \
  --class-slo batch:15000:125 --quiet > $L/real1.out 2>&1)
step done

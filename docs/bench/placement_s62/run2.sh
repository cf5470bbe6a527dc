#!/bin/bash
# As run.sh, from the tree w = the commit that adds the per-class TTFT weight (batch 0.1):
# w (threshold, cost), then w (cost, threshold), twice.
set -u
OUT=/work/main/docs/bench/placement_s62/1p2d
run() {  # run LABEL TREE SYSTEMS
  (cd /tmp/wt_$2 && PYTHONPATH=/tmp/wt_$2 /work/main/.venv/bin/python -m bench.sim.real \
    --out $OUT/$1 --log-dir /tmp/s62/logs_$1 --systems $3 --rates 0.8,1.2 \
    --workload mixed-cpu --num-requests 30 --calibrate 2 --ttft-slo-ms 1000 --tpot-slo-ms 125 \
    --class-slo batch:15000:125 --quiet) > /tmp/s62/$1.out 2>&1
  echo "$1 done $(date +%T)"
}
run w_1 w threshold,cost
run w_2 w cost,threshold
run w_3 w threshold,cost
run w_4 w cost,threshold

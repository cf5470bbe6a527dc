#!/bin/bash
# The cluster-up 1P2D layout at 0.8 and 1.2 req/s, threshold and cost placement, from two
# trees: new = c5e0311 (a prefill worker's stall priced by its scheduler share), old =
# e1617ec (as if the decode worker computed the tokens). Alternated: new (threshold, cost),
# old (cost), new (cost, threshold). TREE is a git worktree of that commit with the ignored
# build outputs (*.so, *_pb2*) copied in.
set -u
OUT=/work/main/docs/bench/placement_s62/1p2d
run() {  # run LABEL TREE SYSTEMS
  (cd /tmp/wt_$2 && PYTHONPATH=/tmp/wt_$2 /work/main/.venv/bin/python -m bench.sim.real \
    --out $OUT/$1 --log-dir /tmp/s62/logs_$1 --systems $3 --rates 0.8,1.2 \
    --workload mixed-cpu --num-requests 30 --calibrate 2 --ttft-slo-ms 1000 --tpot-slo-ms 125 \
    --class-slo batch:15000:125 --quiet) > /tmp/s62/$1.out 2>&1
  echo "$1 done $(date +%T)"
}
run new_1 new threshold,cost
run old_1 old cost
run new_2 new cost,threshold

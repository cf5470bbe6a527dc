#!/bin/bash
# The 1P2D probes and sweeps again at f9f4a46 (a worktree at /tmp/s74/wt2), after
# validate.sh: bench.sim.real's 1P2D as `pdserve cluster up` places it, the prefill worker
# with a thread per CPU (validate.sh's, at c3d7015, ran every worker with --threads 1).
set -u
export PYTHONPATH=/tmp/s74/wt2
PY=/work/main/.venv/bin/python
cd /tmp/s74/wt2
O=/tmp/s74/rec2
mkdir -p $O /tmp/s74/logs2
step() { echo "$1 start $(date +%T)"; }
step probe2; $PY -m bench.sim.real prefill --out $O/prefill_probe_1p2d_zen4_threads --layout 1p2d --concurrency 0,2,4,8 --probes 4 > /tmp/s74/probe2b.out 2>&1
step real2; $PY -m bench.sim.real --out $O/real_1p2d_zen4_threads --log-dir /tmp/s74/logs2/1p2d \
  --systems threshold,cost --rates 0.2,0.45,0.8,1.2 --workload mixed-cpu --num-requests 48 \
  --calibrate 2 --ttft-slo-ms 1000 --tpot-slo-ms 125 --class-slo batch:15000:125 --quiet > /tmp/s74/real2b.out 2>&1
step done

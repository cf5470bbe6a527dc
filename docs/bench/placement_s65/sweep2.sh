#!/bin/bash
# The 1P2D sweep again at 4c19bbe (the lease covers the prefill worker's queue), same command.
set -u
export PYTHONPATH=/tmp/wt_4c19
cd /tmp/wt_4c19
echo "real2b start $(date +%T)"
/work/main/.venv/bin/python -m bench.sim.real --out /tmp/s65/rec2/real_1p2d_zen3_4c19bbe --log-dir /tmp/s65/logs2/1p2d \
  --systems threshold,cost --rates 0.2,0.45,0.8,1.2 --workload mixed-cpu --num-requests 48 \
  --calibrate 2 --ttft-slo-ms 1000 --tpot-slo-ms 125 --class-slo batch:15000:125 --quiet > /tmp/s65/real2b.out 2>&1
echo "real2b done $(date +%T) rc=$?"

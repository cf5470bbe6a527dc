#!/bin/bash
# 1P2D threshold again at a027c7f (the lease fixed at --prefill-timeout), right after the 4c19bbe sweep:
# the machine ran ~20 % faster by then than in the first sweeps, so the before/after pair is this one.
set -u
export PYTHONPATH=/tmp/wt_a027
cd /tmp/wt_a027
echo "real2c start $(date +%T)"
/work/main/.venv/bin/python -m bench.sim.real --out /tmp/s65/rec3/real_1p2d_zen3_a027c7f_again --log-dir /tmp/s65/logs3/1p2d \
  --systems threshold --rates 0.2,0.45,0.8,1.2 --workload mixed-cpu --num-requests 48 \
  --calibrate 2 --ttft-slo-ms 1000 --tpot-slo-ms 125 --class-slo batch:15000:125 --quiet > /tmp/s65/real2c.out 2>&1
echo "real2c done $(date +%T) rc=$?"

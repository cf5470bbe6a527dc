#!/bin/bash
# The pinned 1P1D goodput of docs/bench/goodput_placement/run4 (prefill worker on CPU 0,
# decode worker on CPU 1), threshold and cost, from the tree w (README.md names the commit).
set -u
cd /tmp/wt_w && PYTHONPATH=/tmp/wt_w /work/main/.venv/bin/python -m bench.goodput \
  --systems disaggregated,disaggregated-cost --rates 0.2,0.45,0.8,1.2 --workload mixed-cpu \
  --num-requests 30 --calibrate 2 --ttft-slo-ms 1000 --tpot-slo-ms 125 \
  --class-slo batch:15000:125 --out /work/main/docs/bench/placement_s62/goodput_1p1d \
  --log-dir /tmp/s62/goodput_logs \
  > /tmp/s62/goodput.out 2>&1
echo "goodput done $(date +%T)"

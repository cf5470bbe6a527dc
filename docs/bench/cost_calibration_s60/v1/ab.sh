#!/bin/bash
# Cost placement without and with the TTFT correction, alternated, on one 1P1D cluster layout.
cd /work/main
for round in 1 2; do
  for arm in off on; do
    extra=()
    [ $arm = off ] && extra=(--router-arg=--cost-calibration-window --router-arg=0)
    out=/tmp/s60/ab/${arm}_${round}
    echo "$(date -u +%T) start $arm $round" >> /tmp/s60/ab/progress.log
    .venv/bin/python -m bench.goodput --out $out --log-dir /tmp/s60/ab/logs_${arm}_${round} \
      --systems disaggregated-cost --rates 0.45,0.8,1.2 --workload mixed-cpu \
      --num-requests 48 --calibrate 2 --ttft-slo-ms 1000 --tpot-slo-ms 125 \
      --class-slo batch:15000:125 --quiet "${extra[@]}" > /tmp/s60/ab/${arm}_${round}.log 2>&1
    echo "$(date -u +%T) done $arm $round rc=$?" >> /tmp/s60/ab/progress.log
  done
done

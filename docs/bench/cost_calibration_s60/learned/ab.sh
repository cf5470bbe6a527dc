#!/bin/bash
# Cost placement without and with the learned remote overhead, alternated, 1P1D (bench.goodput).
cd /work/main
for round in 1 2 3; do  # stopped after round 2 (off_3 cancelled for time)
  for arm in off on; do
    extra=()
    [ $arm = off ] && extra=(--router-arg=--remote-overhead-window --router-arg=0)
    out=/tmp/s60/ab3/${arm}_${round}
    echo "$(date -u +%T) start $arm $round" >> /tmp/s60/ab3/progress.log
    .venv/bin/python -m bench.goodput --out $out --log-dir /tmp/s60/ab3/logs_${arm}_${round} \
      --systems disaggregated-cost --rates 0.45,0.65,0.8 --workload mixed-cpu \
      --num-requests 48 --calibrate 2 --ttft-slo-ms 1000 --tpot-slo-ms 125 \
      --class-slo batch:15000:125 --quiet "${extra[@]}" > /tmp/s60/ab3/${arm}_${round}.log 2>&1
    echo "$(date -u +%T) done $arm $round rc=$?" >> /tmp/s60/ab3/progress.log
  done
done

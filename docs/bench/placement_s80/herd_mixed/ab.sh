#!/bin/bash
# Stop 80 (Zen 3): does the herding fix (9d59a04) change 1P2D's mixed-workload sweep? The
# real 1P2D (`pdserve cluster up --prefill 1 --decode 2`, bench.sim.real), threshold
# placement, mixed-cpu at 0.8 req/s (48 requests), from worktrees at 6a7ced3 (before the
# fix) and 2009fa9 (after), alternated: before, after, before, after.
set -u
PY=/work/main/.venv/bin/python
R=/tmp/s80/herd_mixed
mkdir -p $R
for round in 1 2; do
  for side in before:/tmp/old:6a7ced3 after:/tmp/base:2009fa9; do
    name=${side%%:*}; rest=${side#*:}; tree=${rest%%:*}; commit=${rest#*:}
    echo "$name $round ($commit) start $(date +%T)"
    (cd $tree && PYTHONPATH=$tree $PY -m bench.sim.real --out $R/${name}_${round}_$commit \
      --log-dir $R/logs_${name}_${round} --systems threshold --rates 0.8 --workload mixed-cpu \
      --num-requests 48 --calibrate 2 --ttft-slo-ms 1000 --tpot-slo-ms 125 \
      --class-slo batch:15000:125 --quiet > $R/${name}_${round}.out 2>&1)
  done
done
echo "done $(date +%T)"

#!/bin/bash
# An idle 1,146-token prompt on `cluster up`'s 1P2D, interleaved: 3644859 (two threads
# throughout, /tmp/s76/wt0) and bd0e33f (adapting, /tmp/s76/wt2); 4 probes a pass.
set -u
PY=/work/main/.venv/bin/python
O=/tmp/s76/rec2/idle_ab
mkdir -p $O
i=0
for round in 1 2 3; do
  for tree in wt0:3644859 wt2:bd0e33f; do
    i=$((i + 1)); t=/tmp/s76/${tree%%:*}; c=${tree##*:}
    echo "$i $c $(date +%T)" >> $O/ORDER
    (cd $t && PYTHONPATH=$t $PY -m bench.sim.real prefill --out $O/${i}_$c --layout 1p2d \
      --concurrency 0 --probes 4 > /tmp/s76/logs/idle_$i.out 2>&1)
  done
done

#!/bin/bash
# The router harness at 256 (then 64) emulated workers, threshold and cost, at a027c7f (worktree).
# usage: harness.sh WORKERS POLICY...
set -u
export PYTHONPATH=/tmp/wt_a027
PY=/work/main/.venv/bin/python
cd /tmp/wt_a027
W=$1; shift
O=/tmp/s65/rec/harness; mkdir -p $O
for P in "$@"; do
  echo "$W $P start $(date +%T)"
  if [ "$W" = 256 ]; then PH="--light-s 10 --saturate-s 20 --paired 600"; else PH="--light-s 20 --saturate-s 30"; fi
  $PY -m bench.router_harness --workers $W --workloads prefix prefix1 $PH \
    --placement $P --out $O/h${W}_${P}_a027c7f.json > /tmp/s65/harness_${W}_${P}.out 2>&1
  echo "$W $P done $(date +%T) rc=$?"
done

#!/bin/bash
# The router's first tokens against cost placement's predictions, before (c860ab6) and
# after (73e0865: bd0e33f's router) on `cluster up`'s 1P2D: 24 mixed-cpu requests at 0.2
# req/s, cost placement, bench.sim.real at 73e0865 in both trees (the bench code only
# records the router's metrics; the system is each tree's own).
set -u
PY=/work/main/.venv/bin/python
for c in c860ab6 73e0865; do
  t=/tmp/s76/p_$c
  (cd $t && PYTHONPATH=$t $PY -m bench.sim.real --out /tmp/s76/rec3/predictions_$c \
    --systems cost --rates 0.2 --workload mixed-cpu --num-requests 24 --calibrate 0 --quiet \
    > /tmp/s76/logs/predictions_$c.out 2>&1)
  echo "$c done $(date +%T)"
done

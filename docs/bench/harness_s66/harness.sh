#!/bin/bash
# Stop 66 (Zen 4 guest): the router harness at 64 and 256 emulated workers, threshold and
# cost, at this checkout, with stop 65's phases (docs/bench/placement_s65/harness.sh).
# usage: harness.sh WORKERS POLICY...
set -u
cd "$(dirname "$0")/../../.."
PY=.venv/bin/python
W=$1; shift
O=${O:-docs/bench/harness_s66}  # where the records go (stop 67: harness_s67/harness.sh)
for P in "$@"; do
  echo "$W $P start $(date +%T)"
  if [ "$W" = 256 ]; then PH="--light-s 10 --saturate-s 20 --paired 600"; else PH="--light-s 20 --saturate-s 30"; fi
  $PY -m bench.router_harness --workers $W --workloads prefix prefix1 $PH \
    --placement $P --out $O/h${W}_${P}.json > $O/h${W}_${P}.out 2>&1
  echo "$W $P done $(date +%T) rc=$?"
done

#!/bin/bash
# Stop 69 (as stop 68's): the router harness with the router's gRPC API served by grpc.aio (--data-plane
# python) and by the compiled data plane (--data-plane compiled), one after the other, at this
# checkout, with stop 65's phases (as docs/bench/harness_s66/harness.sh).
# usage: harness.sh WORKERS POLICY:PLANE...   e.g. harness.sh 64 cost:python cost:compiled
set -u
cd "$(dirname "$0")/../../.."
PY=.venv/bin/python
O=${O:-docs/bench/dataplane_s69}
W=$1; shift
for RUN in "$@"; do
  P=${RUN%%:*}; D=${RUN##*:}
  echo "$W $P $D start $(date +%T)"
  if [ "$W" = 256 ]; then PH="--light-s 10 --saturate-s 20 --paired 600"; else PH="--light-s 20 --saturate-s 30"; fi
  $PY -m bench.router_harness --workers $W --workloads prefix prefix1 $PH \
    --placement $P --data-plane $D --out $O/h${W}_${P}_${D}.json > $O/h${W}_${P}_${D}.out 2>&1
  echo "$W $P $D done $(date +%T) rc=$?"
done

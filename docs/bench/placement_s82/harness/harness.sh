#!/bin/bash
# Stop 82: the router harness at 64 workers (cost placement, compiled data plane, stop 65's
# phases as dataplane_s68/harness.sh) in three modes, alternated A B C C B A at one commit:
#   lone: the router's defaults, alone on its Redis (sharing on, nobody to share with);
#   off:  --share-inflight 0;
#   peer: one idle peer router on the same Redis, so the measured router exchanges every
#         0.05 s and pushes its counts as it places (what sharing costs a replica).
# usage: harness.sh   (records in $O, default docs/bench/placement_s82/harness)
set -u
cd "$(dirname "$0")/../../../.."
PY=.venv/bin/python
O=${O:-docs/bench/placement_s82/harness}
C=$(git rev-parse --short HEAD)
for RUN in lone:1 off:1 peer:1 peer:2 off:2 lone:2; do
  M=${RUN%%:*}; R=${RUN##*:}
  case $M in
    lone) X="" ;;
    off) X="--share-inflight 0" ;;
    peer) X="--peer-routers 1" ;;
  esac
  echo "$M $R start $(date +%T)"
  $PY -m bench.router_harness --workers 64 --workloads prefix prefix1 --light-s 20 \
    --saturate-s 30 --placement cost --data-plane compiled $X \
    --out $O/h64_${M}${R}_$C.json > $O/h64_${M}${R}_$C.out 2>&1
  echo "$M $R done $(date +%T) rc=$?"
done

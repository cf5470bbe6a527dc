#!/bin/bash
# Stop 82: what sharing costs a router with one peer, before and after its pushes were bounded
# by the whole push's time (make + Redis round trip) instead of the record's making alone.
# The router harness at 64 workers (cost placement, compiled data plane, stop 65's phases)
# with one idle peer router on its Redis (--peer-routers 1), at PREV (a worktree at the
# commit before) and at this checkout, alternated A B C B A, with `off` (--share-inflight 0)
# at this checkout in the middle.
# usage: PREV=/path/to/worktree [RUNS="TREE:MODE:N ..."] peer.sh   (the worktree with .venv and
# the built extensions; RUNS: another sequence, e.g. "this:peer:1 prev:peer:3 this:peer:2")
set -u
cd "$(dirname "$0")/../../../.."
HERE=$(pwd)
O=$HERE/docs/bench/placement_s82/peer
for RUN in ${RUNS:-prev:peer:1 this:peer:1 this:off:1 this:peer:2 prev:peer:2}; do
  T=${RUN%%:*}; R=${RUN##*:}; M=${RUN#*:}; M=${M%%:*}
  if [ $T = prev ]; then TREE=$PREV; else TREE=$HERE; fi
  C=$(git -C $TREE rev-parse --short HEAD)
  X="--peer-routers 1"; [ $M = off ] && X="--share-inflight 0"
  echo "$T $M $R ($C) start $(date +%T)"
  (cd $TREE && .venv/bin/python -m bench.router_harness --workers 64 --workloads prefix prefix1 \
    --light-s 20 --saturate-s 30 --placement cost --data-plane compiled $X \
    --out $O/h64_${M}${R}_$C.json > $O/h64_${M}${R}_$C.out 2>&1)
  echo "$T $M $R done $(date +%T) rc=$?"
done

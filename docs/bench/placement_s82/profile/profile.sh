#!/bin/bash
# Stop 82: where a router's CPU goes when it shares its in-flight counts with a peer. The
# router harness at 64 workers (prefix workload only, cost placement, compiled data plane),
# lone and with one idle peer router (as ../harness/harness.sh); py-spy samples the measured
# router (the oldest `pdserve.cli router`) for the whole run, collapsed stacks (raw format).
# usage: profile.sh   (from the repository root or anywhere; py-spy in .venv)
set -u
cd "$(dirname "$0")/../../../.."
O=docs/bench/placement_s82/profile
C=$(git rev-parse --short HEAD)
for M in lone peer; do
  X=""; [ $M = peer ] && X="--peer-routers 1"
  .venv/bin/python -m bench.router_harness --workers 64 --workloads prefix --light-s 20 \
    --saturate-s 30 --placement cost --data-plane compiled $X \
    --out $O/h64_${M}_$C.json > $O/h64_${M}_$C.out 2>&1 &
  H=$!
  until P=$(pgrep -o -f "pdserve.cli router --port"); do sleep 0.2; done
  .venv/bin/py-spy record -p $P -r 250 -d 600 --format raw -o $O/router_${M}_$C.txt \
    > $O/pyspy_${M}.log 2>&1 &
  wait $H
  sleep 2
done

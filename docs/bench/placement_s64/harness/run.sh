#!/bin/bash
# The router harness at 64 emulated workers, cost and threshold placement one after the
# other, from main at the commit README.md names (router/_score.c built in place).
# usage: run.sh SUFFIX ORDER...   e.g. run.sh e253764 threshold cost
set -u
S=$1; shift
cd /work/main
mkdir -p /tmp/s64
for P in "$@"; do
  .venv/bin/python -m bench.router_harness --workers 64 --workloads prefix prefix1 --light-s 20 \
    --saturate-s 30 --placement $P --out docs/bench/placement_s64/harness/h64_${P}_$S.json \
    > /tmp/s64/harness_${P}_$S.out 2>&1
  echo "$P done $(date +%T)"
done

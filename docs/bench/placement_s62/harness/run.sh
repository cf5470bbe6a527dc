#!/bin/bash
# The router harness at 64 emulated workers with threshold and with cost placement, one
# after the other, from main at the commit README.md names.
set -u
cd /work/main
for P in threshold cost; do
  .venv/bin/python -m bench.router_harness --workers 64 --workloads prefix prefix1 --light-s 20 \
    --saturate-s 30 --placement $P --out docs/bench/placement_s62/harness/h64_${P}.json \
    > /tmp/s62/harness_$P.out 2>&1
  echo "$P done $(date +%T)"
done

#!/bin/bash
# Stop 66: the lease renewal (bc898d1) against 18f894e on a 1P1D cluster, alternating.
# Baseline tree: git worktree add --detach /tmp/wt_base 18f894e, plus its compiled
# extensions and pdserve/v1 stubs (git ls-files -o -i --exclude-standard kvxfer pdserve router).
set -e
out=docs/bench/lease_s66
.venv/bin/python -m bench.lease_renewal --baseline-tree /tmp/wt_base --lease 4 --per-wave 1 \
    --waves 3 --rounds 2 --out $out/alone_lease4.json 2>&1 | grep -E "baseline:|this:|wrote"
.venv/bin/python -m bench.lease_renewal --baseline-tree /tmp/wt_base --lease 8 --per-wave 2 \
    --waves 3 --rounds 2 --out $out/pairs_lease8.json 2>&1 | grep -E "baseline:|this:|wrote"
# Then, at the commit after 1025729 (the cold queue's lease at the prior rate):
#   .venv/bin/python -m bench.lease_renewal --baseline-tree /tmp/wt_base --lease 8 \
#       --per-wave 2 --waves 3 --rounds 3 --out $out/pairs_lease8_prior.json

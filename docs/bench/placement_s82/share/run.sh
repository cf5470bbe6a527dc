#!/bin/bash
# Stop 82: stop 81's two-routers test (../../placement_s81/share/share.py: cluster up's 1P2D,
# four routers, two sharing at the default --share-inflight and two not; one, shared and
# unshared passes at 2, 4 and 8 closed-loop streams, three rounds) at this checkout, then
# busier.py on its record.
set -u
cd "$(dirname "$0")/../../../.."
O=docs/bench/placement_s82/share
C=$(git rev-parse --short HEAD)
PYTHONPATH=. .venv/bin/python docs/bench/placement_s81/share/share.py $O/share_$C.json > $O/share.log 2>&1
echo "rc=$?" >> $O/share.log
python3 docs/bench/placement_s81/share/busier.py $O/share_$C.json > $O/busier.out

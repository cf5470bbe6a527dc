#!/bin/bash
# The batch flood of docs/bench/placement_s62/flood on `pdserve cluster up --prefill 1
# --decode 1` (cost placement, the default), from a git worktree TREE of the commit README.md
# names for LABEL (build outputs built there).
# usage: flood.sh LABEL TREE
set -u
L=$1; TREE=$2; OUT=/work/main/docs/bench/placement_s63/flood
mkdir -p $OUT /tmp/s63
cd /tmp
(PYTHONPATH=$TREE setsid /work/main/.venv/bin/python -m pdserve.cli cluster up --prefill 1 --decode 1 --http-port 18080 --port 18051 > /tmp/s63/flood_$L.log 2>&1 &)
for i in $(seq 1 180); do grep -q "^ready" /tmp/s63/flood_$L.log 2>/dev/null && break; sleep 1; done
(cd $TREE && PYTHONPATH=$TREE /work/main/.venv/bin/python -m bench.class_mix --router 127.0.0.1:18051 \
  --batch-concurrency 16 --interactive 10 --gap-s 3 --interactive-tokens 400 \
  --out $OUT/$L.json > /tmp/s63/flood_$L.out 2>&1)
curl -s 127.0.0.1:18080/metrics | grep -E "^pdserve_router_(rejections|fallbacks|decisions)_total" > $OUT/$L.metrics.txt
pkill -INT -f "pdserve.cli cluster up"; sleep 8; pkill -9 -f "pdserve.cli"; sleep 1
echo "$L $(tail -1 /tmp/s63/flood_$L.out)"

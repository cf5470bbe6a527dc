#!/bin/bash
# The batch flood of docs/bench/interactive_step_s61/batch_flood on `pdserve cluster up
# --prefill 1 --decode 1` from the tree w (git worktree of the commit named in README.md,
# build outputs copied in): threshold (the default) and --placement cost, alternated.
# usage: flood.sh LABEL "cluster flags"
set -u
L=$1; CF=$2; OUT=/work/main/docs/bench/placement_s62/flood; TREE=/tmp/wt_w
mkdir -p $OUT
cd /tmp
(PYTHONPATH=$TREE setsid /work/main/.venv/bin/python -m pdserve.cli cluster up --prefill 1 --decode 1 --http-port 18080 --port 18051 $CF > /tmp/s62/flood_$L.log 2>&1 &)
for i in $(seq 1 180); do grep -q "^ready" /tmp/s62/flood_$L.log 2>/dev/null && break; sleep 1; done
(cd $TREE && PYTHONPATH=$TREE /work/main/.venv/bin/python -m bench.class_mix --router 127.0.0.1:18051 \
  --batch-concurrency 16 --interactive 10 --gap-s 3 --interactive-tokens 400 \
  --out $OUT/$L.json > /tmp/s62/flood_$L.out 2>&1)
curl -s 127.0.0.1:18080/metrics | grep -E "^pdserve_router_rejections_total" > $OUT/$L.rejections.txt
pkill -INT -f "pdserve.cli cluster up"; sleep 8; pkill -9 -f "pdserve.cli"; sleep 1
echo "$L $(tail -1 /tmp/s62/flood_$L.out)"

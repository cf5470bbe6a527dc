#!/bin/bash
# The batch flood of ../batch_flood (threshold placement, the default), before (a worktree of
# 69e37d9 in /tmp/wtb, build outputs copied in) and after (main at c21c360: a remote prefill
# may take its class's --ttft-deadline), alternating, two rounds. The cluster runs the tree
# through PYTHONPATH; bench.class_mix runs from main.
set -u
OUT=$(cd "$(dirname "$0")" && pwd)
one() {  # $1 label, $2 tree
  local L=$1 TREE=$2
  cd /tmp
  (PYTHONPATH=$TREE setsid /work/main/.venv/bin/python -m pdserve.cli cluster up --prefill 1 \
     --decode 1 --http-port 18080 --port 18051 > /tmp/s61/bfw_$L.log 2>&1 &)
  for i in $(seq 1 180); do grep -q "^ready" /tmp/s61/bfw_$L.log 2>/dev/null && break; sleep 1; done
  local D=$(head -1 /tmp/s61/bfw_$L.log | sed 's/.*logs in \(.*\))/\1/')
  (cd /work/main && PYTHONPATH=/work/main .venv/bin/python -m bench.class_mix \
     --router 127.0.0.1:18051 --batch-concurrency 16 --interactive 10 --gap-s 3 \
     --interactive-tokens 400 --out $OUT/$L.json > /tmp/s61/bfw_$L.out 2>&1)
  curl -s 127.0.0.1:18080/metrics | grep -E "^pdserve_router_(rejections|fallbacks)_total" \
    > $OUT/$L.router_counts.txt
  rm -rf /tmp/s61/bfwlogs_$L; cp -r $D /tmp/s61/bfwlogs_$L
  pkill -INT -f "pdserve.cli cluster up"; sleep 8; pkill -9 -f "pdserve.cli"; sleep 1
  echo "$L $(tail -1 /tmp/s61/bfw_$L.out)"
}
for r in 1 2; do
  one before_$r /tmp/wtb
  one after_$r /work/main
done

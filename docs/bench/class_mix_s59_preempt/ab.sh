#!/bin/bash
# A/B: an interactive prompt behind batch prompts that fill a small KV pool, without (before:
# 14e9d7c) and with (after: the worktree's scheduler) admission over worse-class sequences.
set -u
OUT=/tmp/s59/pre
run_one() {  # $1 tree, $2 label
  local tree=$1 label=$2
  (cd $tree && PYTHONPATH=$tree setsid /work/main/.venv/bin/python -m pdserve.cli cluster up --prefill 0 --decode 1 --kv-cache-mb 96 --http-port 18080 --port 18051 > $OUT/cluster_$label.log 2>&1 &)
  for i in $(seq 1 120); do grep -q "^ready" $OUT/cluster_$label.log 2>/dev/null && break; sleep 1; done
  (cd $tree && PYTHONPATH=$tree /work/main/.venv/bin/python -m bench.class_mix --router 127.0.0.1:18051 --batch-concurrency 2 --batch-tokens 900 --interactive 16 --interactive-tokens 400 --gap-s 1.5 --out $OUT/$label.json) > $OUT/cm_$label.out 2>&1
  pkill -INT -f "pdserve.cli cluster up"; sleep 8; pkill -9 -f "pdserve.cli"; sleep 1
  tail -1 $OUT/cm_$label.out | cut -c1-400
}
date
run_one /work/main before_1
run_one /tmp/wt59 after_1
run_one /work/main before_2
run_one /tmp/wt59 after_2
date

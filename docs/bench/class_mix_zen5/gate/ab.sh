#!/bin/bash
# A/B: interactive prompts behind batch ones, 2f66438 (before) vs be1b136 (after), six batch loops, alternating.
set -u
OUT=/work/main/docs/bench/class_mix_zen5/gate
run_one() {  # $1 tree, $2 label
  local tree=$1 label=$2
  (cd $tree && PYTHONPATH=$tree setsid /work/main/.venv/bin/python -m pdserve.cli cluster up --prefill 1 --decode 1 --http-port 18080 --port 18051 > /tmp/s58/cmg_cluster_$label.log 2>&1 &)
  for i in $(seq 1 120); do grep -q "^ready" /tmp/s58/cmg_cluster_$label.log 2>/dev/null && break; sleep 1; done
  (cd $tree && PYTHONPATH=$tree /work/main/.venv/bin/python -m bench.class_mix --router 127.0.0.1:18051 --interactive 12 --batch-concurrency 6 --out $OUT/$label.json) > /tmp/s58/cmg_$label.out 2>&1
  pkill -INT -f "pdserve.cli cluster up"; sleep 8; pkill -9 -f "pdserve.cli"; sleep 1
  tail -1 /tmp/s58/cmg_$label.out
}
run_one /tmp/wt3 before_1
run_one /work/main after_1
run_one /tmp/wt3 before_2
run_one /work/main after_2

#!/bin/bash
# A/B: the stream's last token, f39b770 (before) vs the working tree (after), alternating.
set -u
run_one() {  # $1 tree, $2 label
  local tree=$1 label=$2
  (cd $tree && PYTHONPATH=$tree setsid /work/main/.venv/bin/python -m pdserve.cli cluster up --prefill 1 --decode 1 --http-port 18080 --port 18051 > /tmp/s58/end/cluster_$label.log 2>&1 &)
  for i in $(seq 1 120); do grep -q "^ready" /tmp/s58/end/cluster_$label.log && break; sleep 1; done
  (cd $tree && PYTHONPATH=$tree /work/main/.venv/bin/python -m bench.stream_end --router 127.0.0.1:18051 --requests 24 --concurrency 3 --out /work/main/docs/bench/stream_end_zen5/$label.json) > /tmp/s58/end/$label.out 2>&1
  pkill -INT -f "pdserve.cli cluster up"; sleep 8; pkill -9 -f "pdserve.cli" ; sleep 1
  tail -1 /tmp/s58/end/$label.out
}
run_one /tmp/wt before_1
run_one /work/main after_1
run_one /tmp/wt before_2
run_one /work/main after_2

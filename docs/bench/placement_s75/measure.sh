#!/bin/bash
# Stop 75 (a 2-vCPU Intel Xeon guest): `pdserve cluster up --prefill 1 --decode 2` as
# bench.sim.real runs it, before and after the prefill worker adapts its threads to the
# CPUs the decode workers leave free. BEFORE: a worktree at 3644859 (its prefill worker a
# thread per CPU throughout); AFTER: a worktree at 1be9bad (/tmp/s75/wt5). The same
# commands in one session, one after the other; records made under /tmp/s75/rec*.
# `after-a1a0cfd` was the first try (one time scale, a CPU free below 0.2 busy: an idle
# prompt's first chunk ran on one thread after the stream before it), from /tmp/s75/wt2.
set -u
PY=/work/main/.venv/bin/python
step() { echo "$1 start $(date +%T)"; }
sweep() {  # tree out-dir name
  (cd $1 && PYTHONPATH=$1 $PY -m bench.sim.real --out $2/real_1p2d_xeon_$3 \
    --log-dir /tmp/s75/logs/$3 --systems threshold,cost --rates 0.2,0.45,0.8,1.2 \
    --workload mixed-cpu --num-requests 48 --calibrate 2 --ttft-slo-ms 1000 \
    --tpot-slo-ms 125 --class-slo batch:15000:125 --quiet > /tmp/s75/real_$3.out 2>&1)
}
probe() {  # tree out-dir name
  (cd $1 && PYTHONPATH=$1 $PY -m bench.sim.real prefill --out $2/prefill_probe_1p2d_xeon_$3 \
    --layout 1p2d --concurrency 0,2,4,8 --probes 4 > /tmp/s75/probe_$3.out 2>&1)
}
case "${1:-}" in
  before) step real; sweep /tmp/s75/wt /tmp/s75/rec threads
          step probe; probe /tmp/s75/wt /tmp/s75/rec threads ;;
  after-a1a0cfd) step probe; probe /tmp/s75/wt2 /tmp/s75/rec2 adapt_a1a0cfd
          step real; sweep /tmp/s75/wt2 /tmp/s75/rec2 adapt_a1a0cfd ;;
  after)  step probe; probe /tmp/s75/wt5 /tmp/s75/rec5 adapt
          step real; sweep /tmp/s75/wt5 /tmp/s75/rec5 adapt ;;
esac
step done

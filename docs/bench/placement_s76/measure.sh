#!/bin/bash
# Stop 76 (a 2-vCPU AMD Zen 4 guest): the simulator's same-session inputs, and
# `pdserve cluster up --prefill 1 --decode 2` as bench.sim.real runs it, before and after the
# router prices a prefill worker by the threads it will run. BEFORE: a worktree at c860ab6
# (/tmp/s76/wt); AFTER: a worktree at bd0e33f (/tmp/s76/wt2), which also made the
# simulator's engine-level inputs. The same
# commands in one session, one after the other; records made under /tmp/s76/rec*.
set -u
PY=/work/main/.venv/bin/python
L=/tmp/s76/logs
mkdir -p $L
step() { echo "$1 start $(date +%T)"; }
sweep() {  # tree out-dir name
  (cd $1 && PYTHONPATH=$1 $PY -m bench.sim.real --out $2/real_1p2d_zen4_$3 \
    --log-dir $L/$3 --systems threshold,cost --rates 0.2,0.45,0.8,1.2 \
    --workload mixed-cpu --num-requests 48 --calibrate 2 --ttft-slo-ms 1000 \
    --tpot-slo-ms 125 --class-slo batch:15000:125 --quiet > $L/real_$3.out 2>&1)
}
probe() {  # tree out-dir name
  (cd $1 && PYTHONPATH=$1 $PY -m bench.sim.real prefill --out $2/prefill_probe_1p2d_zen4_$3 \
    --layout 1p2d --concurrency 0,2,4,8 --probes 4 > $L/probe_$3.out 2>&1)
}
inputs() {  # tree out-dir commit: the engine-level inputs (as ../placement_s75/validate.sh)
  cd $1; export PYTHONPATH=$1
  step profile; taskset -c 1 $PY -m bench.engine_profile --threads 1 --out $2/engine_profile_zen4_$3.json > $L/profile.out 2>&1
  step corun; taskset -c 1 $PY -m bench.engine_profile --corun 0 --rounds 3 --out $2/engine_corun_zen4_$3.json > $L/corun.out 2>&1
  step streaming; $PY -m bench.sim.real streaming --out $2/streaming_1p1d_zen4 > $L/streaming.out 2>&1
  step probe1; $PY -m bench.sim.real prefill --out $2/prefill_probe_1p1d_zen4 --layout 1p1d --concurrency 0,2,4,8 --probes 4 > $L/probe1.out 2>&1
  cd - > /dev/null
}
real1() {  # tree out-dir
  (cd $1 && PYTHONPATH=$1 $PY -m bench.goodput --out $2/real_1p1d_zen4 --log-dir $L/1p1d \
    --systems disaggregated,disaggregated-cost --rates 0.2,0.45,0.8,1.2 --workload mixed-cpu \
    --num-requests 48 --calibrate 2 --ttft-slo-ms 1000 --tpot-slo-ms 125 \
    --class-slo batch:15000:125 --quiet > $L/real1.out 2>&1)
}
case "${1:-}" in
  before) step probe; probe /tmp/s76/wt /tmp/s76/rec before
          step real; sweep /tmp/s76/wt /tmp/s76/rec before ;;
  after)  inputs /tmp/s76/wt2 /tmp/s76/rec2 bd0e33f
          step probe; probe /tmp/s76/wt2 /tmp/s76/rec2 after
          step real; sweep /tmp/s76/wt2 /tmp/s76/rec2 after
          step real1; real1 /tmp/s76/wt2 /tmp/s76/rec2 ;;
  high)   step high  # where the two placements saturate (0.2-1.2 req/s met both SLOs)
          (cd /tmp/s76/wt2 && PYTHONPATH=/tmp/s76/wt2 $PY -m bench.sim.real \
            --out /tmp/s76/rec2/real_1p2d_zen4_after_high --log-dir $L/high \
            --systems threshold,cost --rates 1.6,2.0,2.4 --workload mixed-cpu \
            --num-requests 48 --calibrate 2 --ttft-slo-ms 1000 --tpot-slo-ms 125 \
            --class-slo batch:15000:125 --quiet > $L/real_high.out 2>&1) ;;
esac
step done

#!/bin/bash
# Stop 79 (a 2-vCPU AMD Zen 4 guest): the simulator's same-session inputs and the real
# 1P2D (`pdserve cluster up --prefill 1 --decode 2`, bench.sim.real) and 1P1D (bench.goodput)
# sweeps, all from a worktree at 32e227d (/tmp/s79/wt), one after the other; records made
# under /tmp/s79/rec. New in this stop: `streaming --layout 1p2d` (chat streams on 1P2D),
# which calibrates the share of the co-run table the running cluster shows.
set -u
PY=/work/main/.venv/bin/python
T=/tmp/s79/wt
R=/tmp/s79/rec
L=/tmp/s79/logs
C=32e227d
mkdir -p $R $L
cd $T; export PYTHONPATH=$T
step() { echo "$1 start $(date +%T)"; }
step profile; taskset -c 1 $PY -m bench.engine_profile --threads 1 --out $R/engine_profile_zen4_$C.json > $L/profile.out 2>&1
step corun; taskset -c 1 $PY -m bench.engine_profile --corun 0 --rounds 3 --out $R/engine_corun_zen4_$C.json > $L/corun.out 2>&1
step streaming1; $PY -m bench.sim.real streaming --out $R/streaming_1p1d_zen4 > $L/streaming1.out 2>&1
step streaming2; $PY -m bench.sim.real streaming --layout 1p2d --concurrency 2,4,8,12 --out $R/streaming_1p2d_zen4 > $L/streaming2.out 2>&1
step probe1; $PY -m bench.sim.real prefill --out $R/prefill_probe_1p1d_zen4 --layout 1p1d --concurrency 0,2,4,8 --probes 4 > $L/probe1.out 2>&1
step probe2; $PY -m bench.sim.real prefill --out $R/prefill_probe_1p2d_zen4 --layout 1p2d --concurrency 0,2,4,8 --probes 4 > $L/probe2.out 2>&1
step real2; $PY -m bench.sim.real --out $R/real_1p2d_zen4 --log-dir $L/1p2d \
  --systems threshold,cost --rates 0.2,0.45,0.8,1.2 --workload mixed-cpu --num-requests 48 \
  --calibrate 2 --ttft-slo-ms 1000 --tpot-slo-ms 125 --class-slo batch:15000:125 --quiet > $L/real2.out 2>&1
step real1; $PY -m bench.goodput --out $R/real_1p1d_zen4 --log-dir $L/1p1d \
  --systems disaggregated,disaggregated-cost --rates 0.2,0.45,0.8,1.2 --workload mixed-cpu \
  --num-requests 48 --calibrate 2 --ttft-slo-ms 1000 --tpot-slo-ms 125 \
  --class-slo batch:15000:125 --quiet > $L/real1.out 2>&1
step done

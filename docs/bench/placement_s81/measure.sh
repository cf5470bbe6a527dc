#!/bin/bash
# Stop 81 (a 2-vCPU AMD Zen 3 guest): the simulator's same-session inputs and the real
# 1P2D (`pdserve cluster up --prefill 1 --decode 2`, bench.sim.real) and 1P1D (bench.goodput)
# sweeps, from a worktree at $C (/tmp/base81), one after the other; records made under
# /tmp/s81/rec. Stop 80's guest drifted ~10 % slower between the inputs and the sweeps, so
# the step-cost profile and the co-run table are taken again before the 1P1D sweep, and
# the profile once more after it: each sweep can be replayed with the profile taken next
# to it, and the drift is on record.
set -u
PY=/work/main/.venv/bin/python
T=/tmp/base81
R=/tmp/s81/rec
L=/tmp/s81/logs
C=$(git -C $T rev-parse --short HEAD)
mkdir -p $R $L
cd $T; export PYTHONPATH=$T
step() { echo "$1 start $(date +%T)"; }
step profile_a; taskset -c 1 $PY -m bench.engine_profile --threads 1 --out $R/engine_profile_zen3_a_$C.json > $L/profile_a.out 2>&1
step corun_a; taskset -c 1 $PY -m bench.engine_profile --corun 0 --rounds 3 --out $R/engine_corun_zen3_a_$C.json > $L/corun_a.out 2>&1
step streaming1; $PY -m bench.sim.real streaming --out $R/streaming_1p1d_zen3 > $L/streaming1.out 2>&1
step streaming2; $PY -m bench.sim.real streaming --layout 1p2d --concurrency 2,4,8,12 --out $R/streaming_1p2d_zen3 > $L/streaming2.out 2>&1
step probe1; $PY -m bench.sim.real prefill --out $R/prefill_probe_1p1d_zen3 --layout 1p1d --concurrency 0,2,4,8 --probes 4 > $L/probe1.out 2>&1
step probe2; $PY -m bench.sim.real prefill --out $R/prefill_probe_1p2d_zen3 --layout 1p2d --concurrency 0,2,4,8 --probes 4 > $L/probe2.out 2>&1
step real2; $PY -m bench.sim.real --out $R/real_1p2d_zen3 --log-dir $L/1p2d \
  --systems threshold,cost --rates 0.2,0.45,0.8,1.2 --workload mixed-cpu --num-requests 48 \
  --calibrate 2 --ttft-slo-ms 1000 --tpot-slo-ms 125 --class-slo batch:15000:125 --quiet > $L/real2.out 2>&1
step profile_b; taskset -c 1 $PY -m bench.engine_profile --threads 1 --out $R/engine_profile_zen3_b_$C.json > $L/profile_b.out 2>&1
step corun_b; taskset -c 1 $PY -m bench.engine_profile --corun 0 --rounds 3 --out $R/engine_corun_zen3_b_$C.json > $L/corun_b.out 2>&1
step real1; $PY -m bench.goodput --out $R/real_1p1d_zen3 --log-dir $L/1p1d \
  --systems disaggregated,disaggregated-cost --rates 0.2,0.45,0.8,1.2 --workload mixed-cpu \
  --num-requests 48 --calibrate 2 --ttft-slo-ms 1000 --tpot-slo-ms 125 \
  --class-slo batch:15000:125 --quiet > $L/real1.out 2>&1
step profile_c; taskset -c 1 $PY -m bench.engine_profile --threads 1 --out $R/engine_profile_zen3_c_$C.json > $L/profile_c.out 2>&1
step done

#!/bin/bash
# The replays of stop 75, from /work/main at the commit the outputs name: this Xeon's
# validate.sh inputs and 1P1D records with the 1P2D records of measure.sh, the prefill worker
# adapting its threads (`_adapt`, from 1be9bad on) or not (`_threads`, 3644859); with and
# without the co-run table. bench.cluster_sim reads from each record whether it adapted.
set -u
PY=/work/main/.venv/bin/python
export PYTHONPATH=/work/main
H=/work/main/docs/bench
C=$(git -C /work/main rev-parse --short HEAD)
S=$H/placement_s75
run() {  # 1p2d-suffix tag extra...
  local s=$1 tag=$2; shift 2
  (cd $S && $PY -m bench.cluster_sim --profile engine_profile_xeon_1be9bad.json validate \
    --real real_1p1d_xeon:1p1d --real real_1p2d_xeon$s:1p2d --streaming streaming_1p1d_xeon \
    --prefill-probe prefill_probe_1p1d_xeon:1p1d --prefill-probe prefill_probe_1p2d_xeon$s:1p2d \
    "$@" --out $S/validation_xeon${s}_${tag}_$C.json > $S/validation_xeon${s}_${tag}_$C.out 2>&1)
}
CO="--corun $S/engine_corun_xeon_1be9bad.json"
run _adapt corun $CO &
run _adapt no_corun
wait
run _threads corun $CO &
run _threads no_corun
wait

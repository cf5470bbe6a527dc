#!/bin/bash
# The replays of stop 74, from /work/main at the commit the outputs name: the Zen 4 records
# of validate.sh (every worker --threads 1, as before), the same with this session's 1P2D
# records from validate_1p2d_threads.sh (`pdserve cluster up`'s placement: the prefill
# worker a thread per CPU), and stop 73's Zen 5 records; with and without the co-run table.
# bench.cluster_sim takes each record's --threads from its layout.
set -u
PY=/work/main/.venv/bin/python
export PYTHONPATH=/work/main
H=/work/main/docs/bench
C=$(git -C /work/main rev-parse --short HEAD)
run() {  # dir machine 1p2d-suffix tag extra...
  local d=$1 m=$2 s=$3 tag=$4; shift 4
  (cd $d && $PY -m bench.cluster_sim --profile $(ls engine_profile_${m}_*.json) validate \
    --real real_1p1d_$m:1p1d --real real_1p2d_$m$s:1p2d --streaming streaming_1p1d_$m \
    --prefill-probe prefill_probe_1p1d_$m:1p1d --prefill-probe prefill_probe_1p2d_$m$s:1p2d \
    "$@" --out $H/placement_s74/validation_${m}${s}_${tag}_$C.json \
    > $H/placement_s74/validation_${m}${s}_${tag}_$C.out 2>&1)
}
S4=$H/placement_s74
CO4="--corun $S4/engine_corun_zen4_c3d7015.json"
run $S4 zen4 "" corun $CO4 &
run $S4 zen4 "" no_corun
wait
run $S4 zen4 _threads corun $CO4 &
run $S4 zen4 _threads no_corun
wait
run $H/placement_s73 zen5 "" corun --corun $H/placement_s73/engine_corun_zen5_2bd798a.json &
run $H/placement_s73 zen5 "" no_corun
wait

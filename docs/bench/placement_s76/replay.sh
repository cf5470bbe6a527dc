#!/bin/bash
# The replays of stop 76, from /work/main at the commit the outputs name: this Zen 4's
# same-session inputs (measure.sh after, bd0e33f) with its 1P1D and 1P2D records, with and
# without the co-run table. bench.cluster_sim reads from each record whether its prefill
# worker adapted its threads. The first profile (23:12) priced decode steps 11-15 % above
# the cluster's own unloaded TPOT; it was rerun at 00:12 (`_again`), and both are replayed.
set -u
PY=/work/main/.venv/bin/python
export PYTHONPATH=/work/main
S=/work/main/docs/bench/placement_s76
C=$(git -C /work/main rev-parse --short HEAD)
P=${P:-engine_profile_zen4_bd0e33f.json}  # P=engine_profile_zen4_bd0e33f_again.json: the rerun
run() {  # tag extra...
  local tag=$1; shift
  (cd $S && $PY -m bench.cluster_sim --profile $P validate \
    --real real_1p1d_zen4:1p1d --real real_1p2d_zen4_after:1p2d --streaming streaming_1p1d_zen4 \
    --prefill-probe prefill_probe_1p1d_zen4:1p1d --prefill-probe prefill_probe_1p2d_zen4_after:1p2d \
    "$@" --out $S/validation_zen4_${tag}_$C.json > $S/validation_zen4_${tag}_$C.out 2>&1)
}
T=${T:-}  # "_again" with the rerun profile
run corun$T --corun $S/engine_corun_zen4_bd0e33f.json &
run no_corun$T
wait

#!/bin/bash
# The replays of stop 81, from /work/main at the commit the outputs name: this Zen 3's
# same-session inputs and sweeps (measure.sh) replayed with the profile and co-run table
# taken before the sweeps (a) and with those taken between the 1P2D and the 1P1D sweep (b);
# with a, also without the co-run table and with the share of it fitted from the chat
# streams on 1P2D (--streaming-1p2d: Overheads.corun_share), as stop 80 replayed.
set -u
PY=/work/main/.venv/bin/python
export PYTHONPATH=/work/main
S=/work/main/docs/bench/placement_s81
C=$(git -C /work/main rev-parse --short HEAD)
M=c469571  # the measured commit (measure.sh's worktree)
run() {  # tag profile extra...
  local tag=$1 profile=$2; shift 2
  (cd $S && $PY -m bench.cluster_sim --profile engine_profile_zen3_${profile}_$M.json validate \
    --real real_1p1d_zen3:1p1d --real real_1p2d_zen3:1p2d --streaming streaming_1p1d_zen3 \
    --prefill-probe prefill_probe_1p1d_zen3:1p1d --prefill-probe prefill_probe_1p2d_zen3:1p2d \
    "$@" --out $S/validation_zen3_${tag}_$C.json > $S/validation_zen3_${tag}_$C.out 2>&1)
}
run a_corun a --corun $S/engine_corun_zen3_a_$M.json &
run b_corun b --corun $S/engine_corun_zen3_b_$M.json
wait
run a_no_corun a &
run a_corun_share a --corun $S/engine_corun_zen3_a_$M.json --streaming-1p2d $S/streaming_1p2d_zen3
wait

#!/bin/bash
# The replays of stop 80, from /work/main at the commit the outputs name: this Zen 3's
# same-session inputs and sweeps (measure.sh, 2009fa9) replayed without the co-run table,
# with all of it, and with the share of it fitted from the chat streams on 1P2D
# (--streaming-1p2d: Overheads.corun_share).
set -u
PY=/work/main/.venv/bin/python
export PYTHONPATH=/work/main
S=/work/main/docs/bench/placement_s80
C=$(git -C /work/main rev-parse --short HEAD)
P=engine_profile_zen3_2009fa9.json
run() {  # tag extra...
  local tag=$1; shift
  (cd $S && $PY -m bench.cluster_sim --profile $P validate \
    --real real_1p1d_zen3:1p1d --real real_1p2d_zen3:1p2d --streaming streaming_1p1d_zen3 \
    --prefill-probe prefill_probe_1p1d_zen3:1p1d --prefill-probe prefill_probe_1p2d_zen3:1p2d \
    "$@" --out $S/validation_zen3_${tag}_$C.json > $S/validation_zen3_${tag}_$C.out 2>&1)
}
run no_corun &
run corun --corun $S/engine_corun_zen3_2009fa9.json
wait
run corun_share --corun $S/engine_corun_zen3_2009fa9.json --streaming-1p2d $S/streaming_1p2d_zen3

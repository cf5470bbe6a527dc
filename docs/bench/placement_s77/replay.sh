#!/bin/bash
# The replays of stop 77, from /work/main at the commit the outputs name: each record set
# with the simulator's way of sharing the cores before stop 77 (`old`: --free-window-s 0
# --no-barrier) and after (`new`: the defaults), with and without the set's co-run table.
# Sets: this Emerald Rapids guest's (measure.sh and measure2.sh), stop 76's Zen 4 (the rerun
# profile, as ../placement_s76/replay.sh T=_again) and stop 75's Xeon, adapting and with
# two fixed threads (as ../placement_s75/replay.sh). Two at a time (2 CPUs).
set -u
PY=/work/main/.venv/bin/python
export PYTHONPATH=/work/main
H=/work/main/docs/bench
S=$H/placement_s77
C=$(git -C /work/main rev-parse --short HEAD)
OLD="--free-window-s 0 --no-barrier"
emr() {  # tag extra...
  local tag=$1; shift
  (cd $S && $PY -m bench.cluster_sim --profile engine_profile_emr_0611504.json validate \
    --real real_1p1d_emr:1p1d --real real_1p2d_emr:1p2d --streaming streaming_1p1d_emr \
    --prefill-probe prefill_probe_1p1d_emr:1p1d --prefill-probe prefill_probe_1p2d_emr:1p2d \
    "$@" --out $S/validation_emr_${tag}_$C.json > $S/validation_emr_${tag}_$C.out 2>&1)
}
zen4() {
  local tag=$1 D=$H/placement_s76; shift
  (cd $D && $PY -m bench.cluster_sim --profile engine_profile_zen4_bd0e33f_again.json validate \
    --real real_1p1d_zen4:1p1d --real real_1p2d_zen4_after:1p2d --streaming streaming_1p1d_zen4 \
    --prefill-probe prefill_probe_1p1d_zen4:1p1d --prefill-probe prefill_probe_1p2d_zen4_after:1p2d \
    "$@" --out $S/validation_zen4_${tag}_$C.json > $S/validation_zen4_${tag}_$C.out 2>&1)
}
xeon() {  # 1p2d-suffix tag extra...
  local s=$1 tag=$2 D=$H/placement_s75; shift 2
  (cd $D && $PY -m bench.cluster_sim --profile engine_profile_xeon_1be9bad.json validate \
    --real real_1p1d_xeon:1p1d --real real_1p2d_xeon$s:1p2d --streaming streaming_1p1d_xeon \
    --prefill-probe prefill_probe_1p1d_xeon:1p1d --prefill-probe prefill_probe_1p2d_xeon$s:1p2d \
    "$@" --out $S/validation_xeon${s}_${tag}_$C.json > $S/validation_xeon${s}_${tag}_$C.out 2>&1)
}
EC="--corun $S/engine_corun_emr_0611504.json"
ZC="--corun $H/placement_s76/engine_corun_zen4_bd0e33f.json"
XC="--corun $H/placement_s75/engine_corun_xeon_1be9bad.json"
for m in new old; do
  flags=""; [ $m = old ] && flags=$OLD
  emr ${m}_corun $EC $flags & emr ${m}_no_corun $flags; wait
  zen4 ${m}_corun $ZC $flags & zen4 ${m}_no_corun $flags; wait
  xeon _adapt ${m}_corun $XC $flags & xeon _adapt ${m}_no_corun $flags; wait
  xeon _threads ${m}_corun $XC $flags & xeon _threads ${m}_no_corun $flags; wait
done
(cd $S && $PY $H/placement_s75/count.py validation_*_$C.json > counts_$C.txt)

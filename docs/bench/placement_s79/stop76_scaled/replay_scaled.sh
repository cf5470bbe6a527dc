#!/bin/bash
# replay stop 76's Zen 4 records with the co-run table scaled by alpha
PY=/work/main/.venv/bin/python
export PYTHONPATH=/work/main
S=/work/main/docs/bench/placement_s76
P=engine_profile_zen4_bd0e33f_again.json
run() {
  (cd $S && $PY -m bench.cluster_sim --profile $P validate \
    --real real_1p1d_zen4:1p1d --real real_1p2d_zen4_after:1p2d --streaming streaming_1p1d_zen4 \
    --prefill-probe prefill_probe_1p1d_zen4:1p1d --prefill-probe prefill_probe_1p2d_zen4_after:1p2d \
    --corun $2 --out /tmp/s79/val_$1.json > /tmp/s79/val_$1.out 2>&1)
}
echo start $(date +%T)
run a50 /tmp/s79/corun/a50.json &
run a25 /tmp/s79/corun/a25.json
wait
echo mid $(date +%T)
run a75 /tmp/s79/corun/a75.json &
run a100 $S/engine_corun_zen4_bd0e33f.json
wait
echo done $(date +%T)

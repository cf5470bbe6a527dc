#!/bin/bash
# A/B: --interactive-step-target-ms 0 (off: a step holding an interactive prompt takes the
# 750 ms step target's budget) vs 250 (the default), same tree, alternating.
# usage: [LAYOUT="--prefill 1 --decode 1"] ab.sh OUTDIR INTERACTIVE_TOKENS ROUNDS [more bench.class_mix flags]
set -u
OUT=$1; TOK=$2; ROUNDS=$3; shift 3
EXTRA=("$@")
LAYOUT=${LAYOUT:---prefill 1 --decode 1}
mkdir -p $OUT /tmp/s61
run_one() {  # $1 target ms, $2 label
  local target=$1 label=$2
  (cd /work/main && setsid .venv/bin/python -m pdserve.cli cluster up $LAYOUT --http-port 18080 --port 18051 --interactive-step-target-ms $target > /tmp/s61/cm_cluster_$label.log 2>&1 &)
  for i in $(seq 1 180); do grep -q "^ready" /tmp/s61/cm_cluster_$label.log 2>/dev/null && break; sleep 1; done
  (cd /work/main && .venv/bin/python -m bench.class_mix --router 127.0.0.1:18051 --interactive ${NINT:-24} --interactive-tokens $TOK "${EXTRA[@]}" --out $OUT/$label.json) > /tmp/s61/cm_$label.out 2>&1
  pkill -INT -f "pdserve.cli cluster up"; sleep 8; pkill -9 -f "pdserve.cli"; sleep 1
  echo "$label $(tail -1 /tmp/s61/cm_$label.out)"
}
for r in $(seq 1 $ROUNDS); do
  run_one 0 off_$r
  run_one 250 on_$r
done

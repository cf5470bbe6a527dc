#!/bin/bash
# usage: adm.sh OUT LABEL TREE "cluster flags" class_mix flags...
OUT=$1; L=$2; TREE=$3; CF=$4; shift 4
mkdir -p $OUT
cd /tmp
(PYTHONPATH=$TREE setsid /work/main/.venv/bin/python -m pdserve.cli cluster up --prefill 1 --decode 1 --http-port 18080 --port 18051 $CF > /tmp/s61/adm_$L.log 2>&1 &)
for i in $(seq 1 180); do grep -q "^ready" /tmp/s61/adm_$L.log 2>/dev/null && break; sleep 1; done
D=$(head -1 /tmp/s61/adm_$L.log | sed 's/.*logs in \(.*\))/\1/')
(cd /tmp/wt && PYTHONPATH=/tmp/wt /work/main/.venv/bin/python -m bench.class_mix --router 127.0.0.1:18051 "$@" --out $OUT/$L.json > /tmp/s61/adm_$L.out 2>&1)
grep -o '"queued_tokens_interactive"' $D/*.log | head -1
curl -s 127.0.0.1:18080/metrics | grep -E "^pdserve_router_rejections_total" > $OUT/$L.rejections.txt
rm -rf /tmp/s61/admlogs_$L; cp -r $D /tmp/s61/admlogs_$L
pkill -INT -f "pdserve.cli cluster up"; sleep 8; pkill -9 -f "pdserve.cli"; sleep 1
echo "$L $(tail -1 /tmp/s61/adm_$L.out)"

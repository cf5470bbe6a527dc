#!/bin/bash
# usage: cost.sh label [cluster flags]
L=$1; shift
cd /work/main
(setsid .venv/bin/python -m pdserve.cli cluster up --prefill 1 --decode 1 --http-port 18080 --port 18051 "$@" > /tmp/s61/c_$L.log 2>&1 &)
for i in $(seq 1 180); do grep -q "^ready" /tmp/s61/c_$L.log 2>/dev/null && break; sleep 1; done
D=$(head -1 /tmp/s61/c_$L.log | sed 's/.*logs in \(.*\))/\1/')
.venv/bin/python -m bench.class_mix --router 127.0.0.1:18051 --interactive 10 --interactive-tokens 400 --gap-s 4 --out /tmp/s61/$L.json > /tmp/s61/$L.out 2>&1
for f in $D/*.log; do p=$(grep -o '"metrics_port": [0-9]*' $f | head -1 | awk '{print $2}'); [ -n "$p" ] && curl -s 127.0.0.1:$p/metrics > /tmp/s61/m_${L}_$(basename $f .log).txt; done
rm -rf /tmp/s61/logs_$L; cp -r $D /tmp/s61/logs_$L
pkill -INT -f "pdserve.cli cluster up"; sleep 8; pkill -9 -f "pdserve.cli"
tail -1 /tmp/s61/$L.out

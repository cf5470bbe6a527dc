#!/bin/bash
cd /work/main
(setsid .venv/bin/python -m pdserve.cli cluster up --prefill 1 --decode 1 --http-port 18080 --port 18051 > /tmp/s61/diag_cluster.log 2>&1 &)
for i in $(seq 1 180); do grep -q "^ready" /tmp/s61/diag_cluster.log 2>/dev/null && break; sleep 1; done
D=$(head -1 /tmp/s61/diag_cluster.log | sed 's/.*logs in \(.*\))/\1/')
.venv/bin/python -m bench.class_mix --router 127.0.0.1:18051 --interactive 8 --interactive-tokens 400 --gap-s 4 --out /tmp/s61/diag.json > /tmp/s61/diag.out 2>&1
for f in $D/*.log; do grep -o '"metrics_port": [0-9]*' $f | head -1 | awk -v f=$f '{print f, $2}'; done > /tmp/s61/ports
while read f p; do curl -s 127.0.0.1:$p/metrics > /tmp/s61/metrics_$(basename $f .log).txt; done < /tmp/s61/ports
cp -r $D /tmp/s61/diag_logs
pkill -INT -f "pdserve.cli cluster up"; sleep 8; pkill -9 -f "pdserve.cli"

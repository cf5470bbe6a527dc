#!/bin/bash
# interleaved A/B of the grpc.aio plane: c8c5978 vs 41ef6aa, 64 workers, cost
for i in 1 2; do
  for t in base head; do
    mkdir -p /tmp/s71/ab/${t}_$i
    (cd /tmp/s71/$t && O=/tmp/s71/ab/${t}_$i bash docs/bench/dataplane_s68/harness.sh 64 cost:python)
  done
done
echo ALLDONE

#!/bin/bash
# place() in-process at 64 workers: 8e5b9f8 (stop 62's main, cost in numpy; TREE /tmp/wt_base)
# against e253764 (cost in C; main), cost and threshold, two rounds, one after the other.
set -u
D=/work/main/docs/bench/placement_s63/place_warm
for r in 1 2; do
  for P in cost threshold; do
    for T in /tmp/wt_base:8e5b9f8 /work/main:e253764; do
      (cd ${T%%:*} && PYTHONPATH=${T%%:*} /work/main/.venv/bin/python $D/place_warm.py 64 $P \
        > $D/${T##*:}_${P}_$r.txt 2>&1)
      echo "${T##*:} $P $r $(head -1 $D/${T##*:}_${P}_$r.txt)"
    done
  done
done

#!/bin/bash
# A/B of one follower read: ffd4629 (worktree /tmp/wt) without hiredis, against the working
# tree with it; alternating, 3 runs each, N = 64 and 256.
set -e
out=/tmp/s57/poll/ab.jsonl
: > $out
for round in 1 2 3; do
  /work/main/.venv/bin/pip uninstall -q -y hiredis
  for n in 64 256; do (cd /tmp/wt && PYTHONPATH=/tmp/wt /work/main/.venv/bin/python /tmp/s57/poll/poll_bench.py $n 2000 | sed 's/^{/{"tree": "ffd4629", /') >> $out; done
  /work/main/.venv/bin/pip install -q "hiredis>=3.2,<4" 2>/dev/null
  for n in 64 256; do (cd /work/main && PYTHONPATH=/work/main /work/main/.venv/bin/python /tmp/s57/poll/poll_bench.py $n 2000 | sed 's/^{/{"tree": "new", /') >> $out; done
done

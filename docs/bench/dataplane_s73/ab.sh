#!/bin/bash
# Stop 73: text_ab.py from the tree before (2bd798a, a worktree at /tmp/s73/wt) and after
# (this change, a worktree at /tmp/s73/dev), interleaved: before, after, before, after.
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
PY=/work/main/.venv/bin/python
cp "$HERE/text_ab.py" /tmp/s73/text_ab.py
for n in 1 2; do
  for t in wt:before dev:after; do
    tree=/tmp/s73/${t%%:*}; name=${t##*:}
    echo "$name $n start $(date +%T)"
    (cd $tree && PYTHONPATH=$tree $PY /tmp/s73/text_ab.py --out $HERE/text_${name}_$n.json) \
      > $HERE/text_${name}_$n.out 2>&1
    echo "$name $n done $(date +%T) rc=$?"
  done
done

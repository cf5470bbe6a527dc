#!/bin/bash
# Stop 70: stop 68's harness script (../dataplane_s68/harness.sh), its records here.
# usage: harness.sh WORKERS POLICY:PLANE...   e.g. harness.sh 64 cost:python cost:compiled
O=${O:-docs/bench/dataplane_s70} exec bash "$(dirname "$0")/../dataplane_s68/harness.sh" "$@"

#!/bin/bash
# Stop 67 (Xeon guest): the router harness at 64 and 256 emulated workers, threshold and
# cost, at this checkout: stop 66's script (stop 65's phases), records into harness_s67/.
# usage: harness.sh WORKERS POLICY...
O=docs/bench/harness_s67 exec bash "$(dirname "$0")/../harness_s66/harness.sh" "$@"

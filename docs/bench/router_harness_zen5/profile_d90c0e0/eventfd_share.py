"""The event loop thread's busy samples, and the share of them inside `eventfd_write`.

    python eventfd_share.py pyspy_native.txt.gz

The file is py-spy's raw output (`py-spy record -p <router pid> -d 20 -r 400 --native -f raw`)
of the router at d90c0e0 during the saturate phase of `--workers 64 --workloads prefix`. A
sample is the loop thread's if its stack runs the event loop; busy if its innermost frame is
not a wait (`epoll_wait`, or `syscall`: a futex wait).
"""

import gzip
import sys

WAITS = ("epoll_wait (libc.so.6)", "syscall (libc.so.6)")

busy = in_eventfd = 0
with gzip.open(sys.argv[1], "rt") as f:
    for line in f:
        stack, _, n = line.rstrip("\n").rpartition(" ")
        frames = stack.split(";")
        if frames[-1] in WAITS or not any("run_forever" in fr for fr in frames):
            continue
        busy += int(n)
        in_eventfd += int(n) * any(fr.startswith("eventfd_write") for fr in frames)
print(f"loop thread busy samples {busy}, in eventfd_write {in_eventfd} "
      f"({in_eventfd / busy:.1%})")

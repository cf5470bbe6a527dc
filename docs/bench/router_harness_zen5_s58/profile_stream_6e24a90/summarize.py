"""Where the router's event-loop thread spends its busy samples in a py-spy raw profile
(`py-spy record -p PID -d 25 -r 200 --native -f raw`): the thread's native syscalls (with the
frame that called them) and the Python functions, inclusive.

    python summarize.py pyspy_native_raw.txt.gz [loop-thread-prefix]
"""

import collections
import gzip
import re
import sys

path = sys.argv[1]
rows = []
with gzip.open(path, "rt") as f:
    for line in f:
        stack, _, n = line.rstrip().rpartition(" ")
        if stack:
            rows.append((stack.split(";"), int(n)))
threads = collections.Counter()
for frames, n in rows:
    threads[frames[0]] += n
# The event loop's thread is the one running asyncio's loop.
loop_thread = sys.argv[2] if len(sys.argv) > 2 else next(
    t for t in threads if any("run_forever" in f for fr, _ in rows if fr[0] == t for f in fr))
busy = [(fr, n) for fr, n in rows if fr[0] == loop_thread and not fr[-1].startswith("epoll_wait")]
total = sum(n for _, n in busy)
print(f"loop thread {loop_thread}: {sum(n for fr, n in rows if fr[0] == loop_thread)} samples, "
      f"{total} busy")
syscalls = collections.Counter()
for frames, n in busy:
    if frames[-1].startswith(("write ", "sendmsg", "recv ", "syscall", "getpid")):
        caller = next((f for f in reversed(frames[:-1]) if "libc" in f or ".py:" in f),
                      frames[-2])
        syscalls[(frames[-1].split(" ")[0], caller.split(" (")[0])] += n
print("syscalls (busy samples, % of busy):")
for (call, caller), n in syscalls.most_common(8):
    print(f"  {n:5d} {100 * n / total:5.1f} %  {call} <- {caller}")
incl = collections.Counter()
for frames, n in busy:
    seen = set()
    for f in frames:
        if ".py:" not in f:
            continue
        key = re.sub(r":\d+\)$", ")", f)
        if key not in seen:
            seen.add(key)
            incl[key] += n
print("Python, inclusive (busy samples, % of busy):")
for f, n in incl.most_common(60)[9:40]:
    print(f"  {n:5d} {100 * n / total:5.1f} %  {f}")

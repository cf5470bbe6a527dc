"""How many of a process's CPUs other processes leave free, sampled in the background: what
an engine that shares its CPUs at a lower priority sizes its thread pool by
(`EngineConfig.adapt_threads`).

Why: `pdserve cluster up` runs its prefill workers on every CPU at nice 5, beside decode
workers pinned one to a CPU. On free CPUs a prompt computes 1.9x as fast on two threads as on
one (docs/bench/placement_s74). But where a decode worker at nice 0 computes on one of those
CPUs, the prefill worker's thread there gets a quarter of it in scheduler slices of
milliseconds, and every parallel region of a step (a few hundred per forward pass) waits at
its barrier for that thread: a 67-102-token interactive prompt took 1.0-6.7 s instead of
0.1-0.4 s (`pdserve cluster up --prefill 1 --decode 2`, stop 74). One thread on the free CPU
computes at full speed, and beside busy workers a single thread at least never waits for
another one.

The sampler reads the CPUs' busy time (psutil: /proc/stat on Linux, steal included, as the
hypervisor's taking is not ours either) and this process's own CPU time every `period_s`,
and keeps a moving average of the busy CPUs that are not this process's."""

from __future__ import annotations

import threading
import time
from collections.abc import Collection

import psutil

# A CPU counts as free when other processes keep it busy less than this share of the time.
# A decode worker running streams keeps its CPU busy all the time; what else runs beside a
# worker (the router, heartbeats, the KV a decode worker receives after each prompt chunk)
# comes in short bursts, and at a margin of 0.2 those made an idle prefill worker run some
# chunks of a 1,146-token prompt on one thread: 1.8-1.9 s instead of 1.5 (stop 75).
BUSY_MARGIN = 0.5


def busy_seconds(cpus: Collection[int]) -> float:
    """CPU seconds the CPUs `cpus` spent busy since boot (not idle nor waiting for I/O)."""
    times = psutil.cpu_times(percpu=True)
    total = 0.0
    for cpu in cpus:
        if cpu < len(times):
            t = times[cpu]
            total += (t.user + t.nice + t.system + getattr(t, "irq", 0.0)
                      + getattr(t, "softirq", 0.0) + getattr(t, "steal", 0.0))
    return total


def threads_for(free: float, most: int) -> int:
    """Threads for `free` CPUs (`FreeCpus.free`): one per CPU that others leave free but for
    `BUSY_MARGIN`, at least one, at most `most`."""
    return max(1, min(most, int(free + BUSY_MARGIN)))


class FreeCpus:
    """A daemon thread sampling `cpus` (default: the ones this process may run on) every
    `period_s`; `free` is their number minus the moving average of the ones other processes
    kept busy (time constant about `period_s` / `alpha`). `close` stops it."""

    def __init__(self, cpus: Collection[int] | None = None, *, period_s: float = 0.05,
                 alpha: float = 0.3):
        import os

        self.cpus = tuple(sorted(cpus if cpus is not None else os.sched_getaffinity(0)))
        self.period_s, self.alpha = period_s, alpha
        self._others = 0.0  # CPUs other processes keep busy (moving average)
        self._stop = threading.Event()
        self._last = self._read()
        self._thread = threading.Thread(target=self._run, name="pdserve-free-cpus",
                                        daemon=True)
        self._thread.start()

    @property
    def free(self) -> float:
        return max(0.0, len(self.cpus) - self._others)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)

    def _read(self) -> tuple[float, float, float]:
        return time.monotonic(), busy_seconds(self.cpus), time.process_time()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            now = self._read()
            wall = now[0] - self._last[0]
            if wall <= 0.0:
                continue
            others = max(0.0, (now[1] - self._last[1]) - (now[2] - self._last[2])) / wall
            self._others += self.alpha * (min(float(len(self.cpus)), others) - self._others)
            self._last = now


__all__ = ["BUSY_MARGIN", "FreeCpus", "busy_seconds", "threads_for"]

"""How many of a process's CPUs other processes leave free, sampled in the background: what
an engine that shares its CPUs at a lower priority sizes its thread pool by
(`EngineConfig.adapt_threads`).

Why: `pdserve cluster up` runs its prefill workers on every CPU at nice 5, beside decode
workers pinned one to a CPU. On free CPUs a prompt computes 1.9x as fast on two threads as on
one (docs/bench/placement_s74). But where a decode worker at nice 0 computes on one of those
CPUs, the prefill worker's thread there gets a quarter of it in scheduler slices of
milliseconds, and every parallel region of a step (a few hundred per forward pass) waits at
its barrier for that thread: a 67-128-token interactive prompt took up to 5.5 s instead of
0.1-0.3 s (`pdserve cluster up --prefill 1 --decode 2`, docs/bench/placement_s75). One
thread on the free CPU computes at full speed.

A short step (one that computes no part of a prompt of `LONG_STEP_TOKENS` tokens or more:
an interactive prompt, a decode step) runs on one thread always: it gains little from a
second, and where a neighbour starts to compute while it runs it loses seconds (a 94-token
prompt took 2.6 s when a decode worker started a prompt 20 ms after it, stop 75). A long
one (a chunk of a long prompt) loses little on two threads beside a busy neighbour (a
1,146-token prompt beside streams: 12-14 s on two threads or on one), but an idle prompt on
one thread loses a quarter; and what ran just before it was often the stream that had just
ended, or the pipeline that brought the prompt (0.4 s of a busy CPU before each prompt,
stop 75). So it is sized by the last ~2 s (`free`): a neighbour that computes for a second
or more.

The sampler reads the CPUs' busy time (psutil: /proc/stat on Linux, steal included, as the
hypervisor's taking is not ours either) and this process's own CPU time every `period_s`,
and keeps a moving average of the busy CPUs that are not this process's."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Collection
from pathlib import Path

import psutil

# A CPU counts as free when other processes keep it busy less than half the time: a decode
# worker running streams keeps its CPU busy all the time, what else runs beside a worker (the
# router, heartbeats, the KV a decode worker receives) comes in short bursts, and at a margin
# of 0.2 those put an idle prefill worker's chunks on one thread.
BUSY_MARGIN = 0.5
# A step that computes part of a prompt this long counts as long (more than one thread only
# for those). By the prompt, not the chunk: chunks are sized by the measured rate
# (`EngineConfig.step_target_ms`), and a rate measured on one thread would keep them short.
LONG_STEP_TOKENS = 256
# The moving average's span: a neighbour that computes for a second or more (the module's
# docstring); an exponential average with this time constant.
WINDOW_S = 2.0


def busy_seconds(cpus: Collection[int], online: list[int] | None = None) -> float:
    """CPU seconds the CPUs `cpus` spent busy since boot (not idle nor waiting for I/O);
    `online`: `online_cpus` as read before (read again where it no longer fits)."""
    times = psutil.cpu_times(percpu=True)
    where = online if online is not None and len(online) == len(times) else online_cpus()
    if where is None or len(where) != len(times):  # unknown (or changed since): 0, 1, ...
        where = list(range(len(times)))
    total = 0.0
    for cpu, t in zip(where, times, strict=True):
        if cpu in cpus:
            total += (t.user + t.nice + t.system + getattr(t, "irq", 0.0)
                      + getattr(t, "softirq", 0.0) + getattr(t, "steal", 0.0))
    return total


def online_cpus() -> list[int] | None:
    """The online CPUs' numbers, ascending: the CPUs psutil's per-CPU times are of, in their
    order (Linux's /proc/stat lists only online CPUs, so with one offline the list's index
    is not the CPU's number). None where unknown."""
    try:
        text = Path("/sys/devices/system/cpu/online").read_text().strip()
        cpus: list[int] = []
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            cpus.extend(range(int(lo), int(hi or lo) + 1))
    except (OSError, ValueError):
        return None
    return cpus


def threads_for(free: float, most: int) -> int:
    """Threads for `free` CPUs (`FreeCpus.free`): one per CPU that others leave free but for
    `BUSY_MARGIN`, at least one, at most `most`."""
    return max(1, min(most, int(free + BUSY_MARGIN)))


class FreeCpus:
    """A daemon thread sampling `cpus` (default: the ones this process may run on) every
    `period_s`; `free` is their number minus a moving average of the ones other processes
    kept busy, over about `window_s`. `close` stops it."""

    def __init__(self, cpus: Collection[int] | None = None, *, period_s: float = 0.05,
                 window_s: float = WINDOW_S):
        self.cpus = frozenset(cpus if cpus is not None else os.sched_getaffinity(0))
        self._online = online_cpus()  # read once, not every sample
        self.period_s = period_s
        self._alpha = min(1.0, period_s / window_s)
        self._others = 0.0  # CPUs other processes keep busy (moving average)
        self._stop = threading.Event()
        self._last = self._read()
        self._thread = threading.Thread(target=self._run, name="pdserve-free-cpus",
                                        daemon=True)
        self._thread.start()

    @property
    def free(self) -> float:
        return max(0.0, len(self.cpus) - self._others)

    def threads(self, most: int, longest_prompt: int) -> int:
        """Threads for a step that computes part of a prompt of `longest_prompt` tokens (0:
        none): one for a short step, else `threads_for` the CPUs free (the module's
        docstring)."""
        return threads_for(self.free, most) if longest_prompt >= LONG_STEP_TOKENS else 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)

    def _read(self) -> tuple[float, float, float]:
        return (time.monotonic(), busy_seconds(self.cpus, self._online),
                time.process_time())

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            now = self._read()
            wall = now[0] - self._last[0]
            if wall <= 0.0:
                continue
            others = max(0.0, (now[1] - self._last[1]) - (now[2] - self._last[2])) / wall
            self._others += self._alpha * (min(float(len(self.cpus)), others) - self._others)
            self._last = now


__all__ = ["BUSY_MARGIN", "LONG_STEP_TOKENS", "WINDOW_S", "FreeCpus", "busy_seconds",
           "online_cpus", "threads_for"]

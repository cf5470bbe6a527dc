"""Children that die with their supervisor, started without Python in a forked child.

`python -m pdserve.deathsig PARENT_PID -- PROGRAM ARGS...` asks Linux to send SIGTERM to
this process when its parent dies (PR_SET_PDEATHSIG, which survives exec), then execs
PROGRAM. `LocalCluster` starts every child through it (`guarded(argv)`), so no worker or
redis-server outlives a SIGKILLed supervisor.

Why not `subprocess.Popen(preexec_fn=...)`: a preexec_fn makes Python fork and run Python in
the child before exec. grpcio (1.81 and later, grpc/grpc#43055) then restarts its
EventEngine poller thread in the child through its fork handlers, `close_fds` closes the
poller's epoll descriptor under it, and the child aborts (SIGABRT, "Epoll1Poller ...
epoll_wait error: Bad file descriptor") before it execs: about 1 in 300 spawns from a
process with live gRPC channels. Without a preexec_fn, Popen uses vfork/posix_spawn and no
fork handler runs. This module imports nothing but the standard library."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int, sig: signal.Signals = signal.SIGTERM) -> None:
    """Ask Linux to send `sig` to this process when its parent dies. `parent` is the
    supervisor's pid, taken before the spawn: if it is already gone, the signal comes at
    once. A no-op off Linux."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os.kill(os.getpid(), sig)


def guarded(argv: list[str], parent: int | None = None) -> list[str]:
    """`argv` started through this module: it dies with `parent` (default: this process)."""
    return [sys.executable, "-m", "pdserve.deathsig",
            str(os.getpid() if parent is None else parent), "--", *argv]


def main(args: list[str]) -> None:
    if len(args) < 3 or args[1] != "--":
        sys.exit("usage: python -m pdserve.deathsig PARENT_PID -- PROGRAM [ARGS...]")
    die_with_parent(int(args[0]))
    os.execvp(args[2], args[2:])


if __name__ == "__main__":
    main(sys.argv[1:])

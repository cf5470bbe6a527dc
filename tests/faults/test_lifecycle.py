"""Process lifecycle under faults (issue 11): `pdserve cluster up` never leaves a worker behind.

Real processes: `pdserve cluster up` with its private redis-server, a router, one prefill and
one decode worker. The stop times are printed (run with -s) and recorded in
docs/RELIABILITY.md; the assertions only bound them by the drain grace, never by speed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdserve.cluster import free_port
from tests.helpers.cluster_util import ClusterUp

pytestmark = pytest.mark.timeout(900)

READY_TIMEOUT_S = 400.0
# A worker's drain timeout (60 s, the default) plus the slack its watchdog allows (15 s):
# the longest any process may take to stop after SIGTERM.
GRACE_S = 75.0


def _free_port() -> int:
    return free_port()  # below the ephemeral range (pdserve.cluster.free_port)


def _children(pid: int) -> dict[int, str]:
    """Direct children of `pid` -> their command line."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rpartition(")")[2].split()[1])
            if ppid == pid:
                out[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ") \
                    .decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited; only its parent's wait is missing


def _wait_gone(pids: list[int], timeout_s: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if not any(_alive(p) for p in pids):
            return time.monotonic() - start
        time.sleep(0.1)
    left = {p: _alive(p) for p in pids}
    pytest.fail(f"still alive after {timeout_s}s: {left}")


def _start_cluster(model_dir: Path) -> tuple[subprocess.Popen[str], dict[int, str], Path]:
    """`cluster up`, its children (pid -> command line) and the directory of their logs."""
    argv = [sys.executable, "-m", "pdserve.cli", "cluster", "up", "--prefill", "1",
            "--decode", "1", "--model", str(model_dir), "--http-port", str(_free_port()),
            "--port", str(_free_port()), "--ready-timeout", str(READY_TIMEOUT_S)]
    up = ClusterUp(argv, start_new_session=True)
    up.wait_ready(READY_TIMEOUT_S + 30)
    proc = up.proc
    children = _children(proc.pid)
    kinds = " ".join(children.values())
    assert "redis-server" in kinds and "decode-worker" in kinds and "prefill-worker" in kinds \
        and " router " in kinds, children
    started = next(line for line in up.seen if "(logs in " in line)
    return proc, children, Path(started.rsplit("(logs in ", 1)[1].rstrip().rstrip(")"))


def _cleanup(proc: subprocess.Popen[str], children: dict[int, str]) -> None:
    for pid in [proc.pid, *children]:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=10)


def test_sigterm_after_redis_died_stops_everything(model_dir: Path) -> None:
    """Redis is SIGKILLed first; then SIGTERM to `cluster up`: every process (workers whose
    deregistration cannot reach Redis included) exits within its drain grace."""
    proc, children, _ = _start_cluster(model_dir)
    try:
        redis_pid = next(p for p, cmd in children.items() if "redis-server" in cmd)
        os.kill(redis_pid, signal.SIGKILL)
        time.sleep(3)  # let the workers' heartbeats find Redis gone
        os.kill(proc.pid, signal.SIGTERM)
        took = _wait_gone([proc.pid, *children], GRACE_S * 2)  # router, then the workers
        proc.wait(timeout=10)
        print(f"\nSIGTERM with Redis dead: all {len(children) + 1} processes gone in "
              f"{took:.1f}s")
    finally:
        _cleanup(proc, children)


def test_sigkill_of_cluster_up_takes_its_children_down(model_dir: Path) -> None:
    """`cluster up` itself is SIGKILLed (no handler runs): PR_SET_PDEATHSIG stops its
    children, which drain (idle: quickly) and exit."""
    proc, children, _ = _start_cluster(model_dir)
    try:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        took = _wait_gone(list(children), GRACE_S)
        print(f"\nSIGKILL of cluster up: its {len(children)} children gone in {took:.1f}s")
    finally:
        _cleanup(proc, children)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_process_group_stops_everything(model_dir: Path,
                                                         sig: signal.Signals) -> None:
    """The whole process group gets the signal at once (SIGINT: Ctrl-C in a terminal;
    SIGTERM: a service manager): nothing is left running, and Redis (in a group of its own)
    outlives the draining workers, so none of them logs a failed Redis call."""
    proc, children, log_dir = _start_cluster(model_dir)
    try:
        os.killpg(proc.pid, sig)
        took = _wait_gone([proc.pid, *children], GRACE_S * 2)
        proc.wait(timeout=10)
        print(f"\n{sig.name} to the group: all {len(children) + 1} processes gone in "
              f"{took:.1f}s")
    finally:
        _cleanup(proc, children)
    logs = {p.name: p.read_text(errors="replace") for p in log_dir.glob("*.log")}
    assert {"router.log", "decode-0.log", "prefill-0.log"} <= set(logs)
    for name, text in logs.items():
        assert "redis error" not in text, f"{name} lost Redis while draining"

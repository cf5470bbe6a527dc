"""pdserve.deathsig: children die with their supervisor, and nothing forks into Python.

A `preexec_fn` in a process with live gRPC channels makes the child abort before exec now
and then (grpc/grpc#43055; pdserve.deathsig's docstring): no code here may use one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdserve.deathsig import guarded

ROOT = Path(__file__).resolve().parents[1]


def test_no_preexec_fn_anywhere() -> None:
    offenders = [str(p.relative_to(ROOT)) for d in ("pdserve", "router", "prefill_svc",
                                                    "decode_svc", "kvxfer", "bench", "tests")
                 for p in (ROOT / d).rglob("*.py")
                 if p not in (Path(__file__).resolve(), ROOT / "pdserve" / "deathsig.py")
                 and "preexec_fn" in p.read_text()]
    assert offenders == []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0): it is dead once its state says so.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(") ", 1)[1][0] != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_guarded_child_dies_with_its_parent(tmp_path: Path) -> None:
    """A supervisor starts `sleep` through pdserve.deathsig, then is SIGKILLed: the sleep
    gets SIGTERM from the kernel. The supervisor reports the child's pid once it runs."""
    pid_file = tmp_path / "child.pid"
    supervisor = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time\n"
        "from pdserve.deathsig import guarded\n"
        "p = subprocess.Popen(guarded(['sleep', '300']))\n"
        f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
        "time.sleep(300)\n")])
    try:
        deadline = time.monotonic() + 30
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline, "the supervisor never started its child"
            time.sleep(0.05)
        child = int(pid_file.read_text())
        while "sleep" not in Path(f"/proc/{child}/cmdline").read_bytes().decode():
            assert time.monotonic() < deadline, "the child never exec'd sleep"
            time.sleep(0.05)
        supervisor.send_signal(signal.SIGKILL)
        supervisor.wait(10)
        while _alive(child):
            assert time.monotonic() < deadline, "the child outlived its supervisor"
            time.sleep(0.05)
    finally:
        supervisor.kill()
        supervisor.wait(10)


def test_guarded_argv_runs_the_program() -> None:
    out = subprocess.run(guarded(["echo", "hello"]), capture_output=True, text=True, timeout=30,
                         check=True)
    assert out.stdout == "hello\n"

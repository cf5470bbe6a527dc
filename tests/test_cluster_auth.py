"""`pdserve cluster up` with API keys (issue 13, item 1): its readiness check sends a key, so
it reports ready and keeps serving past its readiness timeout instead of tearing the cluster
down. The timeout is the `--ready-timeout` flag, so this waits tens of seconds, not 330.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pdserve.cluster import free_port
from tests.helpers.cluster_util import ClusterUp

KEYS = "sk-first, sk-second"  # as an operator may write it: spaces around the comma
READY_TIMEOUT_S = 60.0
pytestmark = pytest.mark.timeout(600)


def _free_port() -> int:
    return free_port()  # below the ephemeral range (pdserve.cluster.free_port)


def _chat(url: str, key: str | None) -> httpx.Response:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    return httpx.post(f"{url}/v1/chat/completions", headers=headers, timeout=120, json={
        "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4,
        "temperature": 0})


def test_cluster_up_with_api_keys_stays_up(model_dir: Path) -> None:
    http_port = _free_port()
    url = f"http://127.0.0.1:{http_port}"
    argv = [sys.executable, "-m", "pdserve.cli", "cluster", "up", "--prefill", "0",
            "--decode", "1", "--model", str(model_dir), "--http-port", str(http_port),
            "--port", str(_free_port()), "--ready-timeout", str(READY_TIMEOUT_S)]
    started = time.monotonic()
    up = ClusterUp(argv, {**os.environ, "PDSERVE_API_KEYS": KEYS})
    proc, seen = up.proc, up.seen
    try:
        up.wait_ready(READY_TIMEOUT_S + 60)
        assert _chat(url, "sk-second").status_code == 200
        assert _chat(url, None).status_code == 401

        # Past the readiness timeout: still up, still serving.
        time.sleep(max(0.0, started + READY_TIMEOUT_S + 1 - time.monotonic()))
        assert proc.poll() is None, "".join(seen)
        r = _chat(url, "sk-first")
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"]
        # `pdserve ask` takes the key from the environment as the cluster does.
        ask = subprocess.run([sys.executable, "-m", "pdserve.cli", "ask", "Say hi.", "--url", url,
                              "--max-tokens", "4"], capture_output=True, text=True, timeout=120,
                             env={**os.environ, "PDSERVE_API_KEYS": KEYS})
        assert ask.returncode == 0 and ask.stdout.strip(), ask.stderr
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
    assert code == 0, "".join(seen)
    assert not [line for line in seen if "Traceback" in line or "TimeoutError" in line]

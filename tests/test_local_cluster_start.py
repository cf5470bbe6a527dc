"""LocalCluster's start on real processes: the ports it hands its children, and what it says
when a child exits while starting.

A worker that cannot bind its port exits while the cluster waits for it; the error names the
worker and carries the end of its log (why it exited), so a test run's report says it without
the log directory, which is gone with the machine in CI. The log says why because a listener
that cannot bind raises ListenError naming its address."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

import pdserve.cluster as cluster_mod
from pdserve.cluster import LocalCluster, free_port

pytestmark = pytest.mark.timeout(300)


def test_free_port_never_hands_out_a_port_twice() -> None:
    """Ports handed to children that have not bound them yet are still free; handed out again,
    two children race for one port (once in ~22,000 pairs, dozens of clusters a test run)."""
    ports = [free_port() for _ in range(3000)]
    assert len(set(ports)) == len(ports)


def test_a_relative_log_dir_starts_redis(tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Redis runs in the log directory and is handed its config file there: a log directory
    given relative to the caller's working directory was looked up again inside itself, and
    redis-server exited while starting."""
    monkeypatch.chdir(tmp_path)
    c = LocalCluster(prefill=0, decode=0, log_dir=Path("logs"))
    (tmp_path / "logs").mkdir()
    try:
        c.start_redis()
        assert c.redis_url is not None and (tmp_path / "logs" / "redis.conf").exists()
    finally:
        c.close()


def test_a_worker_that_cannot_bind_is_reported_with_its_log(model_dir: Path,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    c = LocalCluster(prefill=0, decode=1, model=str(model_dir),
                     extra_worker_args=("--threads", "1", "--kv-cache-mb", "64"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = int(taken.getsockname()[1])
        try:
            c.start_redis()
            # The decode worker's gRPC port is the next one picked (start_redis picks no other
            # once Redis runs). The router starts, and the cluster waits for the worker.
            picked, real = iter([busy]), cluster_mod.free_port
            monkeypatch.setattr(cluster_mod, "free_port",
                                lambda *a: next(picked, None) or real(*a))
            with pytest.raises(RuntimeError) as info:
                c.start(timeout_s=240)
        finally:
            c.close()
    message = str(info.value)
    assert message.startswith("decode-0 exited with code ")
    assert f"cannot listen on 127.0.0.1:{busy}" in message  # the end of its log says why


async def test_listeners_on_a_taken_port_say_so() -> None:
    """gRPC and metrics listeners on a port another socket holds raise ListenError naming the
    address (the process prints it and exits 1), not grpcio's RuntimeError or a bare OSError."""
    import grpc
    from prometheus_client import CollectorRegistry

    from pdserve.runtime import ListenError, metrics_server, start_server

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = int(taken.getsockname()[1])
        server = grpc.aio.server()
        try:
            with pytest.raises(ListenError, match=f"cannot listen on 127.0.0.1:{busy} \\(gRPC\\)"):
                await start_server(server, "127.0.0.1", busy)
        finally:
            await server.stop(None)
        with pytest.raises(ListenError, match=f"cannot listen on 127.0.0.1:{busy} \\(metrics\\)"):
            with metrics_server(CollectorRegistry(), "127.0.0.1", busy):
                pass

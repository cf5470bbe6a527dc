"""The control plane through Redis faults (issue 11): kill -9 and restart, auth, TLS.

Every test runs its own redis-server on a free port (never 6379) so it can kill and restart
it on the same port. Registry-level tests run in a second or two; the cluster test starts
real workers and streams through the outage.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.cluster import free_port
from pdserve.control.directory import WorkerDirectory
from pdserve.control.registry import WorkerRegistry
from pdserve.control.workers import WorkerInfo
from pdserve.errors import ControlPlaneError
from pdserve.kv_layout import KVLayout

pytestmark = pytest.mark.timeout(600)


def _free_port() -> int:
    return free_port()  # below the ephemeral range (pdserve.cluster.free_port)


class RedisProc:
    """A redis-server we can SIGKILL and start again on the same port (empty: no persistence)."""

    def __init__(self, workdir: Path, *extra: str, port: int | None = None,
                 tls: bool = False) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.skip("redis-server is not installed")
        self.exe, self.workdir, self.extra, self.tls = exe, workdir, extra, tls
        self.port = port or _free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        ports = ["--port", "0", "--tls-port", str(self.port)] if self.tls else \
            ["--port", str(self.port)]
        self.proc = subprocess.Popen(
            [self.exe, *ports, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             *self.extra], cwd=self.workdir, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "redis-server exited while starting"
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


@pytest.fixture
def redis_proc(tmp_path: Path) -> Iterator[RedisProc]:
    r = RedisProc(tmp_path)
    r.start()
    yield r
    r.kill()


LAYOUT = KVLayout(model_id="m", num_layers=2, num_kv_heads=2, head_dim=8, block_size=16,
                  num_blocks=4, dtype="float32")


def _worker(worker_id: str, epoch: int) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role="decode", grpc_address="127.0.0.1:1",
                      model_id="m", epoch=epoch, started_at=time.time())


async def _until(pred, timeout_s: float, what: str) -> float:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        try:
            if await pred():
                return time.monotonic() - start
        except ControlPlaneError:
            pass
        await asyncio.sleep(0.05)
    pytest.fail(f"{what}: not within {timeout_s}s")


# --------------------------------------------------------------------------- kill -9 + restart


async def test_lease_epoch_and_descriptor_come_back_after_redis_restart(
        redis_proc: RedisProc) -> None:
    """Redis is SIGKILLed and restarted empty: the worker's heartbeat re-creates its lease and
    descriptor by itself, restores the epoch counter, and fencing still holds."""
    url = f"redis://127.0.0.1:{redis_proc.port}/0"
    async with WorkerRegistry.from_url(url, namespace="t", op_timeout_s=0.5) as reg, \
            WorkerRegistry.from_url(url, namespace="t", op_timeout_s=0.5) as reader:
        epoch = await reg.next_epoch("d0")
        await reg.register(_worker("d0", epoch), ttl_s=3, heartbeat_s=0.2)
        await reg.publish_descriptor(f"d0:{epoch}", LAYOUT, "127.0.0.1:7000", "d0", epoch)
        redis_proc.kill()
        await asyncio.sleep(1.0)  # heartbeats fail meanwhile; the worker keeps going
        assert not reg.lease_lost.is_set()
        redis_proc.start()  # same port, empty

        async def back() -> bool:
            return await reader.get_worker("d0") is not None

        took = await _until(back, 10, "lease re-created")
        print(f"\nlease re-created {took:.2f}s after Redis returned")
        assert (await reader.get_worker("d0")).epoch == epoch  # type: ignore[union-attr]
        desc = await reader.get_descriptor(f"d0:{epoch}")
        assert desc is not None and desc.epoch == epoch and desc.ucx_address == "127.0.0.1:7000"
        # The restored counter still hands a restart a newer epoch ...
        newer = await reader.next_epoch("d0")
        assert newer > epoch
        # ... whose registration fences the old incarnation off.
        async with WorkerRegistry.from_url(url, namespace="t", op_timeout_s=0.5) as successor:
            await successor.register(_worker("d0", newer), ttl_s=3, heartbeat_s=0.2)
            await asyncio.wait_for(reg.lease_lost.wait(), 5)
            assert (await reader.get_worker("d0")).epoch == newer  # type: ignore[union-attr]


async def test_directory_keeps_last_view_for_bounded_staleness(redis_proc: RedisProc) -> None:
    url = f"redis://127.0.0.1:{redis_proc.port}/0"
    async with WorkerRegistry.from_url(url, namespace="t", op_timeout_s=0.5) as reg, \
            WorkerRegistry.from_url(url, namespace="t", op_timeout_s=0.5) as reader:
        await reg.register(_worker("d0", await reg.next_epoch("d0")), ttl_s=3, heartbeat_s=0.2)
        async with WorkerDirectory(reader, poll_s=0.1, max_staleness_s=2.0) as directory:
            assert set(directory.snapshot()) == {"d0"}
            redis_proc.kill()
            await asyncio.sleep(1.0)
            assert set(directory.snapshot()) == {"d0"}  # last known view, still routable
            assert directory.staleness_s() > 0.5 and not directory.expired

            async def expired() -> bool:
                return directory.expired

            await _until(expired, 10, "directory expired")
            assert dict(directory.snapshot()) == {} and directory.get("d0") is None
            redis_proc.start()

            async def recovered() -> bool:
                return set(directory.snapshot()) == {"d0"}

            took = await _until(recovered, 10, "directory recovered")
            print(f"\ndirectory routable again {took:.2f}s after Redis returned")
            assert directory.staleness_s() < 2.0


async def test_restarted_empty_redis_removes_no_worker(redis_proc: RedisProc) -> None:
    """Redis comes back empty: the directory keeps the workers while they re-write their
    leases, instead of reporting them removed (which would close their streams' channels)."""
    url = f"redis://127.0.0.1:{redis_proc.port}/0"
    async with WorkerRegistry.from_url(url, namespace="t", op_timeout_s=0.5) as reg, \
            WorkerRegistry.from_url(url, namespace="t", op_timeout_s=0.5) as reader:
        await reg.register(_worker("d0", await reg.next_epoch("d0")), ttl_s=3, heartbeat_s=1.0)
        async with WorkerDirectory(reader, poll_s=0.1) as directory:
            kinds: list[str] = []

            async def watch() -> None:
                async for event in directory.events():
                    kinds.append(event.kind)

            watcher = asyncio.create_task(watch())
            redis_proc.kill()
            await asyncio.sleep(1.0)
            redis_proc.start()

            async def back() -> bool:
                return await reader.get_worker("d0") is not None

            await _until(back, 10, "lease re-created")
            await asyncio.sleep(0.5)
            assert set(directory.snapshot()) == {"d0"}
            watcher.cancel()
            assert "removed" not in kinds, kinds


async def test_close_with_redis_dead_is_bounded(redis_proc: RedisProc) -> None:
    """Deregistering into a dead Redis costs one bounded attempt, not retries or hangs."""
    url = f"redis://127.0.0.1:{redis_proc.port}/0"
    reg = WorkerRegistry.from_url(url, namespace="t", op_timeout_s=1.0)
    await reg.register(_worker("d0", await reg.next_epoch("d0")), ttl_s=3, heartbeat_s=0.2)
    redis_proc.kill()
    await asyncio.sleep(0.5)
    start = time.monotonic()
    async with asyncio.timeout(15):
        await reg.close()
    print(f"\nclose() with Redis dead took {time.monotonic() - start:.2f}s")


# --------------------------------------------------------------------------- auth and TLS


async def test_password_in_the_url(tmp_path: Path) -> None:
    r = RedisProc(tmp_path, "--requirepass", "s3cret")
    r.start()
    try:
        url = f"redis://:s3cret@127.0.0.1:{r.port}/0"
        async with WorkerRegistry.from_url(url, namespace="t") as reg:
            await reg.register(_worker("d0", await reg.next_epoch("d0")), ttl_s=3)
            assert [w.worker_id for w in await reg.list_workers()] == ["d0"]
        for bad in (f"redis://127.0.0.1:{r.port}/0", f"redis://:wrong@127.0.0.1:{r.port}/0"):
            async with WorkerRegistry.from_url(bad, namespace="t") as reg:
                with pytest.raises(ControlPlaneError):
                    await reg.list_workers()
    finally:
        r.kill()


async def test_acl_user_in_the_url(tmp_path: Path) -> None:
    r = RedisProc(tmp_path, "--user", "pd", "on", ">pw", "~pdserve:*", "+@all",
                  "--user", "default", "off")
    r.start()
    try:
        async with WorkerRegistry.from_url(f"redis://pd:pw@127.0.0.1:{r.port}/0",
                                           namespace="t") as reg:
            await reg.register(_worker("d0", await reg.next_epoch("d0")), ttl_s=3)
            assert [w.worker_id for w in await reg.list_workers()] == ["d0"]
    finally:
        r.kill()


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return cert, key


async def test_tls_rediss_url(tmp_path: Path) -> None:
    """`rediss://` with the CA in the URL (ssl_ca_certs): the whole registry works over TLS,
    and a client that does not trust the certificate is refused."""
    cert, key = _self_signed(tmp_path)
    r = RedisProc(tmp_path, "--tls-cert-file", str(cert), "--tls-key-file", str(key),
                  "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no",
                  "--requirepass", "pw", tls=True)
    try:
        r.start()
    except (AssertionError, RuntimeError):
        pytest.skip("this redis-server has no TLS support")
    try:
        url = f"rediss://:pw@127.0.0.1:{r.port}/0?ssl_ca_certs={cert}"
        async with WorkerRegistry.from_url(url, namespace="t") as reg:
            epoch = await reg.next_epoch("d0")
            await reg.register(_worker("d0", epoch), ttl_s=3, heartbeat_s=0.5)
            await reg.publish_descriptor(f"d0:{epoch}", LAYOUT, "127.0.0.1:7000", "d0", epoch)
            assert [w.worker_id for w in await reg.list_workers()] == ["d0"]
            assert (await reg.get_descriptor(f"d0:{epoch}")) is not None
        async with WorkerRegistry.from_url(f"rediss://:pw@127.0.0.1:{r.port}/0",
                                           namespace="t") as untrusting:
            with pytest.raises(ControlPlaneError):
                await untrusting.list_workers()
    finally:
        r.kill()


# --------------------------------------------------------------------------- under traffic


def test_redis_kill_and_restart_under_streams(tmp_path: Path, model_dir: Path) -> None:
    """kill -9 Redis while 4 greedy streams run, restart it empty on the same port 3 s later:
    every stream finishes with the reference text, the workers re-register without a restart,
    and a new request succeeds within a few seconds of Redis returning."""
    import httpx

    from pdserve.cluster import LocalCluster

    redis = RedisProc(tmp_path)
    redis.start()
    body = {"model": "default", "prompt": "Once upon a time, in a land far away, there lived a",
            "max_tokens": 48, "temperature": 0}
    try:
        with LocalCluster(prefill=1, decode=1, model=str(model_dir),
                          redis_url=f"redis://127.0.0.1:{redis.port}/0",
                          router_args=("--placement", "threshold",
                                       "--remote-threshold", "1")) as cluster:
            url = f"{cluster.http_url}/v1/completions"
            ref = httpx.post(url, json=body, timeout=300).json()["choices"][0]["text"]
            pids = {n: p.pid for n, p in cluster.procs.items()}
            results: list[tuple[int, str]] = []

            def stream() -> None:
                text, status = [], 0
                try:
                    with httpx.stream("POST", url, json={**body, "stream": True},
                                      timeout=300) as resp:
                        status = resp.status_code
                        for line in resp.iter_lines():
                            if line.startswith("data: {"):
                                data = json.loads(line[6:])
                                if "error" in data:
                                    status = -1
                                for c in data.get("choices", []):
                                    text.append(c.get("text") or "")
                except httpx.HTTPError as exc:
                    status, text = -2, [repr(exc)]
                results.append((status, "".join(text)))

            threads = [threading.Thread(target=stream) for _ in range(4)]
            for t in threads:
                t.start()
            time.sleep(1.5)
            redis.kill()
            time.sleep(3.0)
            redis.start()
            back = time.monotonic()
            # New requests while the streams still run: the first success after Redis returned.
            first_ok = None
            refused = 0
            while time.monotonic() - back < 60:
                sent = time.monotonic() - back
                r = httpx.post(url, json=body, timeout=120)
                if r.status_code == 200:
                    # sent = when the first request that succeeded was sent; it then ran
                    # alongside the 4 streams, which share the CPU with it.
                    first_ok = sent
                    took = time.monotonic() - back - sent
                    assert r.json()["choices"][0]["text"] == ref
                    break
                refused += 1
                time.sleep(0.2)
            for t in threads:
                t.join(timeout=300)
            assert first_ok is not None, f"no new request succeeded; streams: {results}"
            failed = [s for s, _ in results if s != 200]
            wrong = [t for s, t in results if s == 200 and t != ref]
            print(f"\nstreams: {len(results)} done, {len(failed)} failed, {len(wrong)} wrong; "
                  f"first new request that succeeded was sent {first_ok:.2f}s after Redis "
                  f"returned ({refused} refused before it), answered in {took:.2f}s; {results}")
            assert len(results) == 4 and not failed and not wrong
            # Re-registered by themselves: same processes, both listed again.
            assert {n: p.pid for n, p in cluster.procs.items()} == pids
            assert all(p.poll() is None for p in cluster.procs.values())
            workers = httpx.get(f"{cluster.http_url}/v1/pdserve/workers", timeout=10).json()
            assert len(workers["workers"]) == 2, workers
    finally:
        redis.kill()

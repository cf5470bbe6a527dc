"""`router.liveness.Liveness` against a real redis-server, a real worker directory and real gRPC
channels: a worker whose lease lapses is probed, and the probe's verdict only counts while the
worker is still gone.

The worker's address is a TCP listener that accepts and never answers: a health check there
waits out its whole deadline, as one does across a partition."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator

import pytest
from prometheus_client import CollectorRegistry, Counter

from pdserve.control import WorkerDirectory, WorkerInfo, WorkerRegistry
from router.clients import WorkerChannels
from router.liveness import Liveness, LivenessConfig

PROBE_S = 1.5


@pytest.fixture
def silent_address() -> Iterator[str]:
    """host:port of a listener that takes connections (the kernel's backlog) and says nothing."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield f"127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
async def registry(redis_server: str) -> AsyncIterator[WorkerRegistry]:
    async with WorkerRegistry.from_url(redis_server, namespace=f"t{uuid.uuid4().hex[:12]}") \
            as reg:
        yield reg


@contextlib.asynccontextmanager
async def _liveness(registry: WorkerRegistry, address: str
                    ) -> AsyncIterator[tuple[Liveness, WorkerDirectory, WorkerInfo]]:
    info = WorkerInfo(worker_id="p0", role="prefill", grpc_address=address,
                      model_id="tiny-model", epoch=1, started_at=time.time())
    lost = Counter("lost", "workers lost", ["role"], registry=CollectorRegistry())
    tasks: set[asyncio.Task[None]] = set()
    channels = WorkerChannels()
    async with WorkerDirectory(registry, role="prefill", poll_s=0.05) as directory:
        liveness = Liveness(LivenessConfig(lost_probe_timeout_s=PROBE_S), directory, channels,
                            lost, lambda coro: tasks.add(asyncio.ensure_future(coro)))
        try:
            yield liveness, directory, info
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await channels.close()


async def _until(pred: Callable[[], bool], timeout_s: float = 10) -> None:
    """Polls: the directory's view changes on its own poll, with no event to wait on here."""
    async with asyncio.timeout(timeout_s):
        while True:
            if pred():
                return
            await asyncio.sleep(0.02)


async def test_a_worker_back_before_its_probe_ends_is_not_lost(
        registry: WorkerRegistry, silent_address: str) -> None:
    """A partition that heals within the probe's deadline: the worker joined again while the
    probe ran, so the probe's failure is about a link that is back. Once this declared it lost
    for good: it stayed registered and was never sent a request again."""
    async with asyncio.timeout(30):
        async with _liveness(registry, silent_address) as (liveness, directory, info):
            await registry.register(info, ttl_s=5, heartbeat_s=1)
            await _until(lambda: directory.get("p0") is not None)
            await registry.deregister()  # the lease gone
            await _until(lambda: directory.get("p0") is None)
            started = time.monotonic()
            probe = asyncio.ensure_future(liveness.check_left(info))
            await asyncio.sleep(0.2)
            await registry.register(info, ttl_s=5, heartbeat_s=1)  # back, mid-probe
            await _until(lambda: directory.get("p0") is not None)
            liveness.joined("p0")  # the router's "added" handler
            await probe
            assert time.monotonic() - started >= PROBE_S * 0.9  # the probe did fail
            assert not liveness.is_lost("p0")
            await registry.deregister()


async def test_a_worker_still_gone_when_its_probe_fails_is_lost(
        registry: WorkerRegistry, silent_address: str) -> None:
    async with asyncio.timeout(30):
        async with _liveness(registry, silent_address) as (liveness, directory, info):
            await registry.register(info, ttl_s=5, heartbeat_s=1)
            await _until(lambda: directory.get("p0") is not None)
            await registry.deregister()
            await _until(lambda: directory.get("p0") is None)
            await liveness.check_left(info)
            assert liveness.is_lost("p0")
            liveness.joined("p0")  # back later: usable again
            assert not liveness.is_lost("p0")


async def test_worker_clients_are_kept_with_their_channel() -> None:
    """A request's worker client is built once per (address, worker) and kept with its
    channel (its stubs are a callable per RPC): the same object until the channel is
    dropped, a new one on a new channel after."""
    channels = WorkerChannels()
    w = WorkerInfo(worker_id="d0", role="decode", grpc_address="127.0.0.1:1",
                   model_id="tiny-model", epoch=1, started_at=time.time())
    other = WorkerInfo(worker_id="d1", role="decode", grpc_address="127.0.0.1:1",
                       model_id="tiny-model", epoch=1, started_at=time.time())
    try:
        first = channels.decode(w)
        assert channels.decode(w) is first and channels.prefill(w) is channels.prefill(w)
        assert channels.decode(other) is not first and channels.decode(other).worker_id == "d1"
        channels.drop(w.grpc_address, grace_s=0)
        again = channels.decode(w)
        assert again is not first and again._stub is not first._stub
    finally:
        await channels.close()

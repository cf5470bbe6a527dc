"""Control plane against a real redis-server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pdserve.control import (
    KVDescriptor,
    WorkerDirectory,
    WorkerInfo,
    WorkerInfoError,
    WorkerLoad,
    WorkerRegistry,
    make_descriptor_id,
)
from pdserve.control.workers import this_cpus, this_host
from pdserve.errors import ControlPlaneError
from pdserve.kv_layout import KVLayout

LAYOUT = KVLayout(16, 2, 4, 2, 8, "float32", "tiny-model")
REPO = Path(__file__).resolve().parents[1]


def worker(worker_id: str = "d0", role: str = "decode", epoch: int = 1, **kw: object) -> WorkerInfo:
    return WorkerInfo(
        worker_id=worker_id,
        role=role,  # type: ignore[arg-type]
        grpc_address="127.0.0.1:50051",
        model_id="tiny-model",
        epoch=epoch,
        started_at=time.time(),
        **kw,  # type: ignore[arg-type]
    )


async def wait_until(predicate, timeout_s: float, step_s: float = 0.05) -> float:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    while not await predicate():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"condition not met within {timeout_s}s")
        await asyncio.sleep(step_s)
    return time.monotonic() - start


def test_worker_info_json_roundtrip_and_validation() -> None:
    info = worker(ucx_address="127.0.0.1:4000", descriptor_id="d0:1", load={"running": 3})
    assert WorkerInfo.from_json(info.to_json()) == info
    with pytest.raises(WorkerInfoError, match="role"):
        worker(role="both")
    with pytest.raises(WorkerInfoError, match="grpc_address"):
        WorkerInfo("w", "prefill", "nohostport", "m", 1, 0.0)
    with pytest.raises(WorkerInfoError, match="load"):
        worker(load={"running": "many"})


def test_worker_info_where_it_computes() -> None:
    """host_id, cpus and nice (for placement to price CPU sharing) round-trip, are bounded,
    and a record without them (an older worker) reads as unknown (nice 0)."""
    info = worker(host_id=this_host(), cpus=this_cpus(), nice=5)
    assert info.host_id and info.cpus and WorkerInfo.from_json(info.to_json()) == info
    assert worker(cpus=[3, 1, 1]).cpus == (1, 3)
    old = json.loads(worker().to_json())
    del old["host_id"], old["cpus"], old["nice"]
    back = WorkerInfo.from_json(json.dumps(old))
    assert (back.host_id, back.cpus, back.nice) == ("", (), 0)
    for bad in ({"host_id": "x" * 65}, {"host_id": "a b"}, {"cpus": [-1]}, {"cpus": [True]},
                {"cpus": list(range(5000))}, {"cpus": "0-3"}, {"nice": 20}, {"nice": True},
                {"nice": "5"}):
        with pytest.raises(WorkerInfoError):
            worker(**bad)


def test_worker_load_record_round_trip() -> None:
    """One typed load record and one codec: what a worker publishes is what the router reads."""
    load = WorkerLoad(running=2, free_blocks=90, total_blocks=128, waiting=1, awaiting_kv=3,
                      kv_cache_usage=0.3, metrics_port=9100)
    info = worker(load=load)
    back = WorkerInfo.from_json(info.to_json())
    assert back.load == load and back.load.backlog == 4
    assert back.load.engine_running is None  # not published: left out, not 0
    assert "engine_running" not in load.to_dict()
    # A newer worker's extra keys are ignored; a mapping reads like the record.
    assert WorkerLoad.from_dict({**load.to_dict(), "future": 1.0}) == load
    assert worker(load={"running": 2}).load == WorkerLoad(running=2)
    for bad in ({"running": float("nan")}, {"queued_tokens": True}, {"metrics_port": "x"}):
        with pytest.raises(WorkerInfoError, match="load"):
            worker(load=bad)


async def test_register_list_and_deregister(registry: WorkerRegistry) -> None:
    await registry.register(worker("d0"), ttl_s=5)
    async with WorkerRegistry(registry._redis, namespace=registry.namespace) as other:
        await other.register(worker("p0", role="prefill"), ttl_s=5)
        assert [w.worker_id for w in await registry.list_workers()] == ["d0", "p0"]
        assert [w.worker_id for w in await registry.list_workers("prefill")] == ["p0"]
        got = await registry.get_worker("d0")
        assert got is not None and got.role == "decode"
    # leaving `other` deregistered p0
    assert [w.worker_id for w in await registry.list_workers()] == ["d0"]
    await registry.deregister()
    assert await registry.list_workers() == []
    assert await registry.get_worker("d0") is None


async def test_heartbeat_refreshes_lease_and_load(registry: WorkerRegistry) -> None:
    calls = 0

    def load() -> dict[str, float]:
        nonlocal calls
        calls += 1
        return {"running": calls, "free_blocks": 100 - calls}

    await registry.register(worker(), ttl_s=1.0, heartbeat_s=0.2, load_fn=load)
    await asyncio.sleep(1.6)  # well past the TTL: only the heartbeat keeps it alive
    (info,) = await registry.list_workers()
    assert info.load.running >= 3
    assert info.load.free_blocks == 100 - info.load.running


async def test_heartbeat_publishes_cpus_that_changed(registry: WorkerRegistry) -> None:
    """A worker pinned after it registered (bench.goodput pins its 1P1D workers that way)
    publishes its new CPUs with the next heartbeat: placement prices sharing from them."""
    cpus = (0, 1)
    await registry.register(worker(cpus=cpus), ttl_s=5.0, heartbeat_s=1.0,
                            cpus_fn=lambda: cpus)
    cpus = (1,)
    assert await registry.heartbeat()
    (info,) = await registry.list_workers()
    assert info.cpus == (1,) and registry.info is not None and registry.info.cpus == (1,)


async def test_epochs_increase(registry: WorkerRegistry) -> None:
    first = await registry.next_epoch("d0")
    second = await registry.next_epoch("d0")
    assert second == first + 1
    assert await registry.next_epoch("d1") == 1


async def test_newer_epoch_fences_the_old_incarnation(registry: WorkerRegistry) -> None:
    old_epoch = await registry.next_epoch("d0")
    await registry.register(worker("d0", epoch=old_epoch), ttl_s=5, heartbeat_s=1)
    async with WorkerRegistry(registry._redis, namespace=registry.namespace) as new:
        new_epoch = await new.next_epoch("d0")
        await new.register(worker("d0", epoch=new_epoch), ttl_s=5)
        assert await registry.heartbeat() is False
        assert registry.lease_lost.is_set()
        (info,) = await registry.list_workers()
        assert info.epoch == new_epoch
        await registry.deregister()  # must not delete the new incarnation's record
        assert (await new.get_worker("d0")).epoch == new_epoch  # type: ignore[union-attr]
        async with WorkerRegistry(registry._redis, namespace=registry.namespace) as stale:
            with pytest.raises(ControlPlaneError, match="superseded"):
                await stale.register(worker("d0", epoch=old_epoch), ttl_s=5)


async def test_descriptor_publish_get_refresh_delete(registry: WorkerRegistry) -> None:
    epoch = await registry.next_epoch("d0")
    desc_id = make_descriptor_id("d0", epoch)
    await registry.register(worker("d0", epoch=epoch, descriptor_id=desc_id), ttl_s=1.0)
    published = await registry.publish_descriptor(desc_id, LAYOUT, "127.0.0.1:4000", "d0", epoch)
    assert published == KVDescriptor(desc_id, "d0", epoch, "127.0.0.1:4000", LAYOUT)
    await asyncio.sleep(1.5)  # past the TTL: the heartbeat refreshed it
    assert await registry.get_descriptor(desc_id) == published
    assert await registry.get_descriptor(make_descriptor_id("d0", epoch + 1)) is None
    await registry.deregister()
    assert await registry.get_descriptor(desc_id) is None


async def test_descriptor_without_lease_needs_ttl(registry: WorkerRegistry) -> None:
    with pytest.raises(ValueError, match="ttl_s"):
        await registry.publish_descriptor("d0:1", LAYOUT, "127.0.0.1:4000", "d0", 1)
    await registry.publish_descriptor("d0:1", LAYOUT, "127.0.0.1:4000", "d0", 1, ttl_s=0.3)
    assert await registry.get_descriptor("d0:1") is not None
    await asyncio.sleep(0.5)
    assert await registry.get_descriptor("d0:1") is None


async def _until(events, pred, timeout_s: float = 10):  # type: ignore[no-untyped-def]
    """The first event matching ``pred`` (earlier ones, e.g. load updates, are skipped)."""
    async def scan():  # type: ignore[no-untyped-def]
        while not pred(ev := await anext(events)):
            pass
        return ev
    return await asyncio.wait_for(scan(), timeout_s)


async def test_directory_follows_workers(registry: WorkerRegistry) -> None:
    # Once flaky (a hang in a Redis call): the heartbeat task, cancelled by deregister() every
    # few runs in mid-command, could leave a pooled connection in a bad state. Commands now run
    # shielded from cancellation (ControlStore.call). Bounded so it cannot stall the suite.
    async with asyncio.timeout(30):
        await _follow_workers(registry)


async def _follow_workers(registry: WorkerRegistry) -> None:
    async with WorkerDirectory(registry, role="decode", poll_s=0.1) as directory:
        events = directory.events()
        pending = asyncio.ensure_future(anext(events))
        await asyncio.sleep(0)
        await registry.register(worker("d0"), ttl_s=5, heartbeat_s=0.1,
                                load_fn=lambda: WorkerLoad(queued=1))
        first = await asyncio.wait_for(pending, 10)
        assert (first.kind, first.worker.worker_id) == ("added", "d0")
        # The first heartbeat's load may land before or after the poll that saw the worker.
        await registry.heartbeat()  # do not depend on when the background beat gets scheduled
        if first.worker.load.queued != 1:
            await _until(events, lambda e: e.kind == "updated" and e.worker.load.queued == 1)
        assert directory.get("d0") is not None
        await registry.deregister()
        await _until(events, lambda e: (e.kind, e.worker.worker_id) == ("removed", "d0"))
        assert dict(directory.snapshot()) == {}
        await events.aclose()


async def test_directory_events_can_start_with_the_known_workers(
        registry: WorkerRegistry) -> None:
    """`events(known=True)` yields the workers known at its first step as "added", then
    its changes (subscribed before the snapshot is taken: nothing falls between)."""
    async with asyncio.timeout(30):
        await registry.register(worker("d0"), ttl_s=5, heartbeat_s=0.1)
        async with WorkerDirectory(registry, role="decode", poll_s=0.1) as directory:
            await directory.refresh()
            assert directory.get("d0") is not None
            events = directory.events(known=True)
            first = await anext(events)
            assert (first.kind, first.worker.worker_id) == ("added", "d0")
            await registry.deregister()
            await _until(events, lambda e: (e.kind, e.worker.worker_id) == ("removed", "d0"))
            await events.aclose()


async def test_directory_listeners_run_after_each_poll(registry: WorkerRegistry) -> None:
    """`on_refresh` listeners run after every successful poll, with the new view in place
    (the router builds its placement table then); one that raises does not stop the
    others nor the polls."""
    async with asyncio.timeout(30):
        await registry.register(worker("d0"), ttl_s=5, heartbeat_s=0.1)
        seen: list[tuple[int, bool]] = []
        directory = WorkerDirectory(registry, role="decode", poll_s=0.05)

        def broken() -> None:
            raise RuntimeError("a listener's bug")

        directory.on_refresh(broken)
        directory.on_refresh(lambda: seen.append(
            (directory.generation, directory.get("d0") is not None)))
        async def three() -> bool:
            return len(seen) >= 3

        async with directory:
            await wait_until(three, timeout_s=10)
        gens = [g for g, _ in seen]
        assert gens == sorted(set(gens)) and all(known for _, known in seen)
        await registry.deregister()


async def test_crashed_worker_drops_out(redis_server: str, namespace: str) -> None:
    """A worker killed with SIGKILL stops heartbeating; its lease lapses within ~TTL."""
    script = textwrap.dedent(
        f"""
        import asyncio, time
        from pdserve.control import WorkerInfo, WorkerRegistry

        async def main():
            reg = WorkerRegistry.from_url({redis_server!r}, namespace={namespace!r})
            info = WorkerInfo("crashy", "prefill", "127.0.0.1:1", "m", 1, time.time())
            await reg.register(info, ttl_s=2.0, heartbeat_s=0.5)
            print("ready", flush=True)
            await asyncio.sleep(60)

        asyncio.run(main())
        """
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, stdout=asyncio.subprocess.PIPE, cwd=REPO
    )
    try:
        assert proc.stdout is not None
        async with asyncio.timeout(30):
            while (line := await proc.stdout.readline()).strip() != b"ready":  # after any logs
                assert line, "worker process exited before registering"
        async with WorkerRegistry.from_url(redis_server, namespace=namespace) as reg:
            async with WorkerDirectory(reg, poll_s=0.2) as directory:
                assert directory.get("crashy") is not None
                await asyncio.sleep(2.5)  # longer than the TTL: heartbeats keep it alive
                assert directory.get("crashy") is not None
                proc.kill()

                async def gone() -> bool:
                    return directory.get("crashy") is None

                assert await wait_until(gone, timeout_s=4.0) < 3.0
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()


async def test_unreachable_redis_is_a_control_plane_error(namespace: str) -> None:
    async with WorkerRegistry.from_url(
        "redis://127.0.0.1:1/0", namespace=namespace, op_timeout_s=0.5
    ) as reg:
        with pytest.raises(ControlPlaneError):
            await reg.list_workers()


async def test_closing_leaves_no_connection_open(redis_server: str, namespace: str) -> None:
    """close() ends a command still running (here one blocked in Redis), then closes every
    connection, including any a running command opened after the pool was closed (redis-py's
    pool has none of its own state for that: such a socket was left to the garbage collector,
    a ResourceWarning in some later test). Commands after close() fail at once."""
    reg = WorkerRegistry.from_url(redis_server, namespace=namespace)
    await reg.register(worker("d0"), ttl_s=5, heartbeat_s=1)
    blocked = asyncio.ensure_future(
        reg.call(reg.redis.blpop([reg.key("nothing")], timeout=20), timeout_s=30))
    await asyncio.sleep(0.2)
    started = time.monotonic()
    await reg.close()
    with pytest.raises(ControlPlaneError):
        await blocked
    assert time.monotonic() - started < 2
    pool = reg.redis.connection_pool
    conns = [*pool._available_connections, *pool._in_use_connections]  # type: ignore[attr-defined]
    assert conns and not any(c.is_connected for c in conns)
    with pytest.raises(ControlPlaneError, match="closed"):
        await reg.list_workers()

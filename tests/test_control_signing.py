"""Signed control-plane records (issue 21, item 1) against a real redis-server and real UCX:
what someone else writes into Redis is never used.

- Worker records, KV descriptors and KV event entries are signed by their writer; a reader
  with the cluster's signer drops unsigned, mis-signed (another secret, another namespace,
  another kind of record, a field changed) and stale records, and logs that at a bounded rate.
- A rewritten descriptor is never dialled: a real KVSender that looks descriptors up through
  a signing registry opens no connection to the forged address (the same sender without a
  signer does: the test would catch a regression).
- A directory given a model id never lists workers serving other weights.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

import pytest

from kvxfer.sender import KVSender
from pdserve.control import WorkerDirectory, WorkerInfo, WorkerRegistry
from pdserve.control.kv_events import KVEventStreams
from pdserve.control.signing import RecordSigner, SignatureError, signer_for
from pdserve.errors import KVTransferError
from pdserve.kv_events import KVEventBatch, KVOp
from pdserve.kv_layout import KVLayout
from pdserve.rpc.auth import ClusterSecret

SECRET = ClusterSecret(b"control-signing-test-" + uuid.uuid4().hex.encode())
OTHER = ClusterSecret(b"an-attackers-own-secret-" + uuid.uuid4().hex.encode())
LAYOUT = KVLayout(16, 2, 4, 2, 8, "float32", "tiny-model")


def _worker(worker_id: str, *, role: str = "decode", model_id: str = "tiny-model",
            grpc_address: str = "127.0.0.1:50051", **kw: object) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role=role,  # type: ignore[arg-type]
                      grpc_address=grpc_address, model_id=model_id, epoch=1,
                      started_at=time.time(), **kw)  # type: ignore[arg-type]


@pytest.fixture
def namespace() -> str:
    return f"s{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def signed(redis_server: str, namespace: str) -> AsyncIterator[WorkerRegistry]:
    async with WorkerRegistry.from_url(redis_server, namespace=namespace,
                                       signer=signer_for(SECRET, namespace)) as reg:
        yield reg


@pytest.fixture
async def rogue(redis_server: str, namespace: str) -> AsyncIterator[WorkerRegistry]:
    """Someone with write access to Redis: no signer, or one under another secret."""
    async with WorkerRegistry.from_url(redis_server, namespace=namespace) as reg:
        yield reg


def test_signer_binds_kind_namespace_and_every_field() -> None:
    s = RecordSigner(SECRET.derive("control-records"), "ns")
    raw = s.sign_json("worker", {"a": 1, "b": [1.5, "x"]}, timestamp=True)
    assert s.verify_json("worker", raw, timestamp=True) == {"a": 1, "b": [1.5, "x"]}
    # Field order on the wire does not matter; values, kind and namespace do.
    data = json.loads(raw)
    assert s.verify_json("worker", json.dumps(dict(reversed(data.items()))), timestamp=True)
    for bad in ({**data, "a": 2}, {k: v for k, v in data.items() if k != "sig"},
                {**data, "extra": True}):
        with pytest.raises(SignatureError):
            s.verify_json("worker", json.dumps(bad), timestamp=True)
    with pytest.raises(SignatureError):
        s.verify_json("kvdesc", raw, timestamp=True)
    with pytest.raises(SignatureError):
        RecordSigner(SECRET.derive("control-records"), "other-ns").verify_json(
            "worker", raw, timestamp=True)
    # A replay of an old record is refused once it is older than max_age_s.
    later = RecordSigner(SECRET.derive("control-records"), "ns", max_age_s=60,
                         clock=lambda: time.time() + 61)
    with pytest.raises(SignatureError, match="replay"):
        later.verify_json("worker", raw, timestamp=True)
    fields = {b"epoch": b"1", b"ops": b"\x01" * 17}
    signed_fields = s.sign_fields("kvev", "d0", fields)
    assert s.verify_fields("kvev", "d0", signed_fields) == fields
    with pytest.raises(SignatureError):
        s.verify_fields("kvev", "d1", signed_fields)  # another worker's stream
    with pytest.raises(SignatureError):
        s.verify_fields("kvev", "d0", {**signed_fields, b"epoch": b"2"})
    assert "control-signing" not in repr(s)


async def test_forged_worker_records_are_never_listed(signed: WorkerRegistry,
                                                      rogue: WorkerRegistry,
                                                      namespace: str) -> None:
    await signed.register(_worker("d0"), ttl_s=10)
    await rogue.register(_worker("unsigned"), ttl_s=10)
    async with WorkerRegistry.from_url(_url(signed), namespace=namespace,
                                       signer=signer_for(OTHER, namespace)) as other:
        await other.register(_worker("other-secret"), ttl_s=10)
        # A copy of a real, signed record with its address changed.
        raw = json.loads(await signed.redis.get(signed.worker_key("d0")))
        raw.update(worker_id="tampered", grpc_address="10.9.9.9:1")
        await signed.redis.sadd(signed.key("workers"), "tampered")
        await signed.redis.set(signed.worker_key("tampered"), json.dumps(raw), px=10_000)

        listed = [w.worker_id for w in await signed.list_workers()]
        assert listed == ["d0"]
        for forged in ("unsigned", "other-secret", "tampered"):
            assert await signed.get_worker(forged) is None
        # An open reader (no secret) still reads signed records, e.g. `pdserve` tools.
        assert {w.worker_id for w in await rogue.list_workers()} >= {"d0", "unsigned"}
        # Refusals are counted; the log gets at most one line per kind per interval.
        assert signed._rejected.total >= 6


async def test_a_listed_record_is_decoded_once_and_still_ages_out(redis_server: str,
                                                                   namespace: str) -> None:
    """The directory reads the same record bytes several times per heartbeat: a listing
    reuses what it verified (the same object back), but a record that stays unchanged in
    Redis is still refused once it is older than `max_age_s` (a replay cannot ride the
    cache), and a changed record is verified again."""
    now = [time.time()]
    signer = RecordSigner(SECRET.derive("control-records"), namespace, max_age_s=60,
                          clock=lambda: now[0])
    async with WorkerRegistry.from_url(redis_server, namespace=namespace,
                                       signer=signer) as reg:
        await reg.register(_worker("d0"), ttl_s=30)
        first = await reg.list_workers()
        again = await reg.list_workers()
        assert [w.worker_id for w in first] == ["d0"] and again[0] is first[0]
        assert len(reg._decoded) == 1
        refused = reg._rejected.total
        now[0] += 61  # nobody re-signed it: the same bytes, now too old
        assert await reg.list_workers() == []
        assert reg._rejected.total == refused + 1 and not reg._decoded
        # Re-signed (as a heartbeat does): new bytes, verified again and listed.
        await reg.redis.set(reg.worker_key("d0"), reg._encode_worker(first[0]), px=10_000)
        assert [w.worker_id for w in await reg.list_workers()] == ["d0"]
        # Tampered bytes are not in the cache, so they are verified (and refused).
        raw = json.loads(await reg.redis.get(reg.worker_key("d0")))
        raw["grpc_address"] = "10.9.9.9:1"
        await reg.redis.set(reg.worker_key("d0"), json.dumps(raw), px=10_000)
        assert await reg.list_workers() == []


def _url(reg: WorkerRegistry) -> str:
    kw = reg.redis.connection_pool.connection_kwargs
    return f"redis://{kw['host']}:{kw['port']}/0"


async def test_a_rewritten_descriptor_is_never_dialled(signed: WorkerRegistry,
                                                       rogue: WorkerRegistry) -> None:
    """A forged descriptor points KV writes at a listener of the attacker's: with a signing
    registry the sender never connects; without one it would (control)."""
    received: list[int] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        received.append(0)
        try:
            while data := await reader.read(4096):
                received[-1] += len(data)
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    trap = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    trap_addr = f"127.0.0.1:{trap.sockets[0].getsockname()[1]}"
    try:
        await signed.publish_descriptor("d0:1", LAYOUT, "127.0.0.1:9", "d0", 1, ttl_s=30)
        raw = json.loads(await signed.redis.get(signed.descriptor_key("d0:1")))
        raw["ucx_address"] = trap_addr  # the attacker's rewrite, old signature kept
        await signed.redis.set(signed.descriptor_key("d0:1"), json.dumps(raw), px=30_000)
        await rogue.publish_descriptor("d9:1", LAYOUT, trap_addr, "d9", 1, ttl_s=30)
        assert await signed.get_descriptor("d0:1") is None
        assert await signed.get_descriptor("d9:1") is None

        async with KVSender(LAYOUT, signed.get_descriptor) as sender:
            for descriptor_id in ("d0:1", "d9:1"):
                with pytest.raises(KVTransferError):
                    await sender.warmup(descriptor_id=descriptor_id, timeout_s=3.0)
        await asyncio.sleep(0.2)
        assert received == [], "a forged descriptor was dialled"

        # Control: the same sender over a registry without a signer dials the trap.
        async with KVSender(LAYOUT, rogue.get_descriptor) as sender:
            with pytest.raises(KVTransferError):  # the trap speaks no UCX
                await sender.warmup(descriptor_id="d9:1", timeout_s=3.0)
        for _ in range(50):
            if received:
                break
            await asyncio.sleep(0.05)
        assert received, "the control did not reach the trap: the test proves nothing"
    finally:
        trap.close()


async def test_forged_kv_events_are_refused(signed: WorkerRegistry,
                                            rogue: WorkerRegistry) -> None:
    streams, forged = KVEventStreams(signed), KVEventStreams(rogue)
    h = bytes(range(16))
    await streams.publish("d0", KVEventBatch(1, 1, 16, ((KVOp.STORED, h),), snapshot=True))
    await forged.publish("d0", KVEventBatch(1, 2, 16, ((KVOp.STORED, h[::-1]),)))
    entries = await streams.read({"d0": b"0"}, block_ms=100)
    assert [e.batch is not None for e in entries] == [True, False]
    assert entries[1].error == "unsigned entry"


async def test_directory_skips_workers_of_another_model(signed: WorkerRegistry) -> None:
    await signed.register(_worker("p-other", role="prefill", model_id="other-weights"), ttl_s=10)
    async with WorkerRegistry.from_url(_url(signed), namespace=signed.namespace,
                                       signer=signed.signer) as second:
        await second.register(_worker("p-same", role="prefill"), ttl_s=10)
        async with WorkerDirectory(signed, role="prefill", model_id="tiny-model") as d:
            assert list(d.snapshot()) == ["p-same"]
        async with WorkerDirectory(signed, role="prefill") as d:
            assert sorted(d.snapshot()) == ["p-other", "p-same"]
        # A router takes every format of its weights (int8 workers' KV ids end in +int8);
        # a worker only its own format.
        async with WorkerRegistry.from_url(_url(signed), namespace=signed.namespace,
                                           signer=signed.signer) as third:
            await third.register(_worker("p-int8", role="prefill",
                                         model_id="tiny-model+int8"), ttl_s=10)
            async with WorkerDirectory(signed, role="prefill", model_id="tiny-model",
                                       any_format=True) as d:
                assert sorted(d.snapshot()) == ["p-int8", "p-same"]
            async with WorkerDirectory(signed, role="prefill", model_id="tiny-model") as d:
                assert list(d.snapshot()) == ["p-same"]
            async with WorkerDirectory(signed, role="prefill", model_id="tiny-model+int8") as d:
                assert list(d.snapshot()) == ["p-int8"]

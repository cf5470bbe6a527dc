"""Authenticated KV writes (issue 11) over real UCX on loopback, with the decode worker's own
sender check (`decode_svc.main._kv_auth`) against a real Redis: a write with no, a wrong or a
tampered signature, or from a sender id that is not a registered prefill worker, is refused
before any receive is posted (no byte lands), the transfer it named stays expected, and the
receiver keeps serving the real prefill worker."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import AsyncIterator

import pytest
import torch

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

import ucxx

from decode_svc.main import DecodeConfig, _kv_auth
from kvxfer import KVReceiver, KVSender
from kvxfer.auth import KVAuth, mac_of
from kvxfer.pool import digest
from kvxfer.protocol import CTRL_TAG, data_tag, recv_frame, reply_tag, send_frame
from pdserve.control import KVDescriptor, WorkerRegistry, make_descriptor_id
from pdserve.control.directory import WorkerDirectory
from pdserve.control.workers import WorkerInfo
from pdserve.errors import ErrorCode, KVTransferError
from pdserve.kv_layout import KVLayout
from pdserve.rpc.auth import ClusterSecret

pytestmark = pytest.mark.timeout(120)

LAYOUT = KVLayout(num_blocks=16, num_layers=2, block_size=16, num_kv_heads=4, head_dim=64,
                  dtype="float32", model_id="tiny")
DESC_ID = make_descriptor_id("decode-a", 3)
SECRET = ClusterSecret(b"this-cluster-secret-0123456789")
OTHER = ClusterSecret(b"another-cluster-secret-987654")


def pool(seed: int) -> torch.Tensor:
    return torch.randn(LAYOUT.shape, generator=torch.Generator().manual_seed(seed))


class Resolver:
    def __init__(self, desc: KVDescriptor) -> None:
        self.desc = desc

    async def __call__(self, descriptor_id: str) -> KVDescriptor | None:
        return self.desc if descriptor_id == self.desc.descriptor_id else None


def info(worker_id: str, role: str) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role=role, grpc_address="127.0.0.1:1",  # type: ignore[arg-type]
                      model_id="tiny", epoch=1, started_at=time.time())


@pytest.fixture
async def cluster(redis_server: str) -> AsyncIterator[dict[str, object]]:
    """A decode side as the worker builds it (registry, prefill directory, KV auth), one
    registered prefill worker ("prefill-a") and one registered decode worker ("decode-b")."""
    ns = f"kvauth{uuid.uuid4().hex[:8]}"
    dst = pool(1)
    async with (WorkerRegistry.from_url(redis_server, namespace=ns) as registry,
                WorkerRegistry.from_url(redis_server, namespace=ns) as prefill_reg,
                WorkerRegistry.from_url(redis_server, namespace=ns) as decode_reg):
        await prefill_reg.register(info("prefill-a", "prefill"), ttl_s=10)
        await decode_reg.register(info("decode-b", "decode"), ttl_s=10)
        async with WorkerDirectory(registry, role="prefill") as prefills:
            config = DecodeConfig(worker_id="decode-a", redis_url=redis_server,
                                  cluster_secret=SECRET)
            auth = _kv_auth(config, registry, prefills)
            assert auth is not None
            async with KVReceiver(dst, LAYOUT, DESC_ID, auth=auth, fence_grace_s=0.1) as rx:
                desc = KVDescriptor(DESC_ID, "decode-a", 3, rx.address, LAYOUT)
                yield {"rx": rx, "dst": dst, "resolver": Resolver(desc),
                       "registry": registry, "ns": ns}


async def _send(cluster: dict[str, object], auth: KVAuth | None, xid: str,
                dst_ids: list[int]) -> None:
    src = pool(2)
    async with KVSender(LAYOUT, cluster["resolver"], auth=auth) as tx:  # type: ignore[arg-type]
        await tx.send(DESC_ID, src, [0, 1], dst_ids, xid, 10, notice={"first_token": 7})


async def _refused(cluster: dict[str, object], auth: KVAuth | None) -> str:
    """Send a write that must be refused; check nothing moved and the transfer still waits,
    then let the real prefill worker write it. Returns the refusal message."""
    rx: KVReceiver = cluster["rx"]  # type: ignore[assignment]
    dst: torch.Tensor = cluster["dst"]  # type: ignore[assignment]
    before = dst.clone()
    xid = uuid.uuid4().hex
    landed = rx.expect(xid, [4, 5], timeout_s=30)
    with pytest.raises(KVTransferError) as refused:
        await _send(cluster, auth, xid, [4, 5])
    assert refused.value.code == ErrorCode.KV_UNAUTHENTICATED
    assert torch.equal(dst, before)  # not one byte landed
    assert not landed.done()  # the forger could not fail someone else's transfer
    # The receiver keeps serving: the registered prefill worker writes the same transfer.
    await _send(cluster, KVAuth(SECRET.kv_key, sender_id="prefill-a"), xid, [4, 5])
    assert await landed == {"first_token": 7}
    assert torch.equal(dst[[4, 5]], pool(2)[[0, 1]])
    return str(refused.value)


async def test_registered_prefill_worker_writes(cluster: dict[str, object]) -> None:
    rx: KVReceiver = cluster["rx"]  # type: ignore[assignment]
    xid = uuid.uuid4().hex
    landed = rx.expect(xid, [9, 10], timeout_s=30)
    await _send(cluster, KVAuth(SECRET.kv_key, sender_id="prefill-a"), xid, [9, 10])
    assert await landed == {"first_token": 7}


async def test_unsigned_write_is_refused(cluster: dict[str, object]) -> None:
    assert "not signed" in await _refused(cluster, None)


async def test_another_clusters_secret_is_refused(cluster: dict[str, object]) -> None:
    assert "signature is wrong" in await _refused(cluster, KVAuth(OTHER.kv_key,
                                                                  sender_id="prefill-a"))


async def test_the_grpc_token_does_not_sign_writes(cluster: dict[str, object]) -> None:
    key = bytes.fromhex(SECRET.grpc_token)  # derived for another purpose
    assert "signature is wrong" in await _refused(cluster, KVAuth(key, sender_id="prefill-a"))


async def test_unregistered_sender_is_refused(cluster: dict[str, object]) -> None:
    message = await _refused(cluster, KVAuth(SECRET.kv_key, sender_id="prefill-ghost"))
    assert "not a registered prefill worker" in message


async def test_a_decode_worker_is_not_a_prefill_worker(cluster: dict[str, object]) -> None:
    message = await _refused(cluster, KVAuth(SECRET.kv_key, sender_id="decode-b"))
    assert "not a registered prefill worker" in message


async def test_prefill_worker_registered_after_the_directory_poll(
        cluster: dict[str, object], redis_server: str) -> None:
    """A prefill worker that registered a moment ago (not yet in the decode worker's
    directory) is looked up in Redis instead of being refused."""
    rx: KVReceiver = cluster["rx"]  # type: ignore[assignment]
    async with WorkerRegistry.from_url(redis_server, namespace=str(cluster["ns"])) as reg:
        await reg.register(info("prefill-new", "prefill"), ttl_s=10)
        xid = uuid.uuid4().hex
        landed = rx.expect(xid, [12], timeout_s=30)
        src = pool(2)
        async with KVSender(LAYOUT, cluster["resolver"],  # type: ignore[arg-type]
                            auth=KVAuth(SECRET.kv_key, sender_id="prefill-new")) as tx:
            await tx.send(DESC_ID, src, [3], [12], xid, 10)
        assert await landed is None


async def test_tampered_or_stale_frames_are_refused_and_no_data_lands(
        cluster: dict[str, object]) -> None:
    """Raw frames: a correctly signed write whose runs were changed afterwards, one signed
    long ago, and a replayed copy of a good one are refused and their endpoint disconnected;
    data pushed on the transfer's tags after the refusal does not land (no receive was ever
    posted)."""
    rx: KVReceiver = cluster["rx"]  # type: ignore[assignment]
    dst: torch.Tensor = cluster["dst"]  # type: ignore[assignment]
    host, port = rx.address.rsplit(":", 1)
    xid = uuid.uuid4().hex
    landed = rx.expect(xid, [14, 15], timeout_s=30)
    before = dst.clone()
    signer = KVAuth(SECRET.kv_key, sender_id="prefill-a")
    data = pool(4)[[0, 1]].contiguous().view(-1).view(torch.uint8).numpy()
    write = {"op": "write", "transfer_id": xid, "descriptor_id": DESC_ID,
             "layout": LAYOUT.to_wire(), "runs": [[14, 2]], "notice": None,
             "digests": [digest(data)]}
    tampered = signer.sign({**write, "seq": 1})
    tampered["runs"] = [[13, 2]]
    stale = {**write, "seq": 1, "sender_id": "prefill-a", "ts": time.time() - 3600,
             "nonce": "00"}
    stale["mac"] = mac_of(SECRET.kv_key, stale)
    good = signer.sign({**write, "seq": 1})
    replayed_ping = signer.sign({"op": "ping", "seq": 1})
    ep = await ucxx.create_endpoint(host, int(port))
    try:  # the ping authenticates, the copy of it does not
        await send_frame(ep, CTRL_TAG, replayed_ping, 5)
        assert (await recv_frame(ep, reply_tag(1), 5))["op"] == "pong"
    finally:
        ep.abort()
    for frame, why in ((tampered, "signature is wrong"), (stale, "time"),
                       (replayed_ping, "replay")):
        ep = await ucxx.create_endpoint(host, int(port))
        try:
            await send_frame(ep, CTRL_TAG, frame, 5)
            reply = await recv_frame(ep, reply_tag(1), 5)
            assert reply["op"] == "reject" and reply["code"] == ErrorCode.KV_UNAUTHENTICATED
            assert why in reply["message"]
            with pytest.raises((ucxx.exceptions.UCXError, TimeoutError)):  # disconnected
                await asyncio.wait_for(ep.send(data, tag=data_tag(1, 0)), 2)
                await send_frame(ep, CTRL_TAG, good, 2)
                await recv_frame(ep, reply_tag(1), 2)
        finally:
            ep.abort()
    await asyncio.sleep(0.3)
    assert torch.equal(dst, before) and not landed.done()
    # A new endpoint's correctly signed write lands.
    ep = await ucxx.create_endpoint(host, int(port))
    try:
        await send_frame(ep, CTRL_TAG, good, 5)
        assert (await recv_frame(ep, reply_tag(1), 5))["op"] == "accept"
        await asyncio.wait_for(ep.send(data, tag=data_tag(1, 0)), 10)
        assert (await recv_frame(ep, reply_tag(1), 10))["op"] == "done"
        assert await landed is None
        assert torch.equal(dst[[14, 15]], pool(4)[[0, 1]])
    finally:
        ep.abort()


async def test_receiver_without_a_secret_takes_signed_and_unsigned_writes() -> None:
    """No secret configured: today's behaviour (tests and the single-host default)."""
    dst = pool(5)
    async with KVReceiver(dst, LAYOUT, DESC_ID) as rx:
        resolver = Resolver(KVDescriptor(DESC_ID, "decode-a", 3, rx.address, LAYOUT))
        for auth in (None, KVAuth(SECRET.kv_key, sender_id="prefill-a")):
            xid = uuid.uuid4().hex
            landed = rx.expect(xid, [1], timeout_s=10)
            async with KVSender(LAYOUT, resolver, auth=auth) as tx:
                await tx.send(DESC_ID, pool(6), [2], [1], xid, 10)
            assert await landed is None

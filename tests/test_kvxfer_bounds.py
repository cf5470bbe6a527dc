"""The KV listener before authentication, and the integrity of the bytes after it (issue 21
items 4 and 2), over real UCX endpoints on loopback.

- 300 connections that idle or only ping and 1,000 refused writes (unsigned, or signed with
  another cluster's secret) neither lock out a registered prefill worker (its transfer lands
  within its usual timeout, bytes checked) nor flood the log;
- an authenticated connection may idle, but not for ever, and never while a transfer runs
  over it; the sender replaces an endpoint the receiver closed, transparently;
- bytes altered in flight after a correctly signed request are refused: the transfer fails
  with ``kv_integrity_failed``, nothing is handed over, and the blocks are fenced.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import structlog
import torch

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

import ucxx

from kvxfer import KVReceiver, KVSender
from kvxfer.auth import KVAuth
from kvxfer.pool import PoolBytes
from kvxfer.protocol import CTRL_TAG, recv_frame, reply_tag, send_frame
from pdserve.control import KVDescriptor, make_descriptor_id
from pdserve.errors import ErrorCode, KVTransferError
from pdserve.kv_layout import KVLayout
from pdserve.rpc.auth import ClusterSecret

pytestmark = pytest.mark.timeout(240)

LAYOUT = KVLayout(num_blocks=16, num_layers=2, block_size=16, num_kv_heads=4, head_dim=64,
                  dtype="float32", model_id="tiny")
DESC_ID = make_descriptor_id("decode-a", 5)
SECRET = ClusterSecret(b"this-cluster-secret-0123456789")
OTHER = ClusterSecret(b"another-cluster-secret-987654")
FRAME_TIMEOUT_S = 2.0


def pool(seed: int) -> torch.Tensor:
    return torch.randn(LAYOUT.shape, generator=torch.Generator().manual_seed(seed))


async def is_prefill_worker(sender_id: str) -> bool:
    return sender_id == "prefill-a"


def receiver_auth() -> KVAuth:
    return KVAuth(SECRET.kv_key, authorize_sender=is_prefill_worker)


def writer(secret: ClusterSecret = SECRET, sender_id: str = "prefill-a") -> KVAuth:
    return KVAuth(secret.kv_key, sender_id=sender_id)


def resolver(rx: KVReceiver) -> Any:
    async def resolve(descriptor_id: str) -> KVDescriptor | None:
        return KVDescriptor(DESC_ID, "decode-a", 5, rx.address, LAYOUT) \
            if descriptor_id == DESC_ID else None
    return resolve


def host_port(rx: KVReceiver) -> tuple[str, int]:
    host, port = rx.address.rsplit(":", 1)
    return host, int(port)


async def transfer(rx: KVReceiver, tx: KVSender, dst_ids: list[int], seed: int,
                   timeout_s: float = 10.0) -> float:
    """A real transfer within `timeout_s`: the destination holds the source bytes. Returns
    how long it took."""
    src = pool(seed)
    src_ids = list(range(len(dst_ids)))
    xid = uuid.uuid4().hex
    landed = rx.expect(xid, dst_ids, timeout_s=timeout_s)
    started = time.monotonic()
    await tx.send(DESC_ID, src, src_ids, dst_ids, xid, timeout_s, notice={"first_token": seed})
    assert await landed == {"first_token": seed}
    assert torch.equal(rx._pool.tensor[dst_ids], src[src_ids])
    return time.monotonic() - started


@pytest.fixture
async def rx() -> AsyncIterator[KVReceiver]:
    async with KVReceiver(pool(1), LAYOUT, DESC_ID, auth=receiver_auth(),
                          frame_timeout_s=FRAME_TIMEOUT_S, fence_grace_s=0.1,
                          fence_timeout_s=3.0) as receiver:
        yield receiver


# --------------------------------------------------------------------------- before auth


async def _junk_connection(host: str, port: int, kind: str, stop: asyncio.Event) -> None:
    """Connect and idle, or ping (unsigned) every 0.5 s, until `stop` or the receiver drops
    us."""
    try:
        ep = await ucxx.create_endpoint(host, port)
    except ucxx.exceptions.UCXError:
        return
    try:
        seq = 0
        while not stop.is_set():
            if kind == "ping":
                seq += 1
                await send_frame(ep, CTRL_TAG, {"op": "ping", "seq": seq}, 2)
                await recv_frame(ep, reply_tag(seq), 2)
            with_timeout = asyncio.create_task(stop.wait())
            await asyncio.wait({with_timeout}, timeout=0.5)
            with_timeout.cancel()
    except (ucxx.exceptions.UCXError, TimeoutError):
        pass  # dropped: evicted, or idle too long
    finally:
        ep.abort()


async def _refused_write(host: str, port: int, i: int) -> str:
    """One write the receiver must refuse (unsigned, or signed under another secret) on its
    own connection; the reply's code, or "dropped" if the connection went before it."""
    frame: dict[str, Any] = {"op": "write", "seq": 1, "transfer_id": "victim",
                             "descriptor_id": DESC_ID, "layout": LAYOUT.to_wire(),
                             "runs": [[0, 1]], "notice": None}
    if i % 2:
        frame = writer(OTHER).sign(frame)
    ep = await ucxx.create_endpoint(host, port)
    try:
        await send_frame(ep, CTRL_TAG, frame, 5)
        return str((await recv_frame(ep, reply_tag(1), 5))["code"])
    except (ucxx.exceptions.UCXError, TimeoutError):
        return "dropped"
    finally:
        ep.abort()


async def test_idle_pinging_and_refused_peers_do_not_lock_out_a_prefill_worker(
        rx: KVReceiver) -> None:
    """300 junk connections (half idle, half pinging) and 1,000 refused writes, with the
    receiver's default limits (256 authenticated, 32 unauthenticated connections). Before
    this change 256 pinging connections took every slot for ever. A prefill worker that was
    connected before the flood and one that connects during it both write within their
    usual 10 s timeout; unauthenticated connections never exceed 32; the refusals cost a
    handful of log lines, not 1,000."""
    host, port = host_port(rx)
    stop = asyncio.Event()
    peak_unauth = 0

    async def watch() -> None:
        nonlocal peak_unauth
        while True:
            peak_unauth = max(peak_unauth, len(rx._unauthenticated))
            await asyncio.sleep(0.02)

    watcher = asyncio.create_task(watch())
    victim = rx.expect("victim", [0], timeout_s=120)  # what every refused write names
    block0 = rx._pool.tensor[0].clone()
    with structlog.testing.capture_logs() as logs:
        async with KVSender(LAYOUT, resolver(rx), auth=writer()) as early:
            await early.warmup(descriptor_id=DESC_ID)  # a signed ping: authenticated
            junk = [asyncio.create_task(_junk_connection(host, port, kind, stop))
                    for kind in ("idle", "ping") * 150]
            await asyncio.sleep(1.0)  # every junk connection made and served or dropped
            codes: list[str] = []
            for i in range(0, 1000, 25):
                codes += await asyncio.gather(*(_refused_write(host, port, i + j)
                                                for j in range(25)))
                if i == 500:  # mid-flood: the warm endpoint and a new one both work
                    took = await transfer(rx, early, [2, 3], seed=2)
                    async with KVSender(LAYOUT, resolver(rx), auth=writer()) as late:
                        took_new = await transfer(rx, late, [4, 5, 6], seed=3)
            stop.set()
            await asyncio.gather(*junk)
            after = await transfer(rx, early, [7], seed=4)
    watcher.cancel()
    # KV transfer's own lines: the session's event loop may still run another test's tasks
    # (a router of an earlier test that did not stop logged its Redis gone here once).
    warnings = [e for e in logs if e["log_level"] in ("warning", "error")
                and e["event"].startswith("kv_")]
    print(f"\n{len(warnings)} warning lines: {[e['event'] for e in warnings]}")
    print(f"flood: transfers took {took:.3f}s (warm), {took_new:.3f}s (new), "
          f"{after:.3f}s (after); {codes.count('dropped')} writes dropped unanswered; "
          f"unauthenticated connections peaked at {peak_unauth}; "
          f"refusals { {e: n.total for e, n in rx._peer_logs.items()} }")
    # Refused, or evicted by newer connections before the refusal came: none wrote a byte.
    assert set(codes) <= {ErrorCode.KV_UNAUTHENTICATED, "dropped"}
    assert not victim.done() and torch.equal(rx._pool.tensor[0], block0)
    assert codes.count(ErrorCode.KV_UNAUTHENTICATED) >= 700  # 986-1,000 here; evictions drop some
    assert (rx._peer_logs["kv_write_unauthenticated"].total
            >= codes.count(ErrorCode.KV_UNAUTHENTICATED))
    assert peak_unauth <= 32
    by_event = {e["event"] for e in warnings}
    assert len(warnings) <= 2 * len(by_event) <= 8, warnings  # one line per event per 30 s
    assert "kv_transfer_finished" not in {e["event"] for e in warnings}
    # Nothing stays connected but the prefill worker's endpoint (closed with its sender).
    await asyncio.sleep(0.5)
    assert not rx._conns
    await rx.cancel("victim")


async def test_unauthenticated_connections_must_keep_talking(rx: KVReceiver) -> None:
    """An unsigned ping earns nothing: the connection is dropped after `frame_timeout_s` of
    silence (before: a ping made it idle-tolerant for ever), while a signed ping's connection
    stays."""
    host, port = host_port(rx)
    ep = await ucxx.create_endpoint(host, port)
    try:
        await send_frame(ep, CTRL_TAG, {"op": "ping", "seq": 1}, 2)
        assert (await recv_frame(ep, reply_tag(1), 2))["op"] == "pong"
        async with KVSender(LAYOUT, resolver(rx), auth=writer()) as tx:
            await tx.warmup(descriptor_id=DESC_ID)
            assert len(rx._conns) == 2 and len(rx._unauthenticated) == 1
            await asyncio.sleep(FRAME_TIMEOUT_S + 1.0)
            assert len(rx._conns) == 1 and not rx._unauthenticated  # the signed one is left
            (peer,) = tx._peers.values()
            await transfer(rx, tx, [1, 2], seed=5)
            assert list(tx._peers.values()) == [peer]  # the same endpoint, never replaced
    finally:
        ep.abort()


async def test_authenticated_connections_idle_for_a_bounded_time() -> None:
    """Authenticated: may idle up to `idle_timeout_s`, then the receiver closes the endpoint
    and the sender replaces it without the caller noticing; a transfer whose data comes
    later than the idle limit is not cut off."""
    async with KVReceiver(pool(1), LAYOUT, DESC_ID, auth=receiver_auth(),
                          frame_timeout_s=FRAME_TIMEOUT_S, idle_timeout_s=1.0) as rx:
        async with KVSender(LAYOUT, resolver(rx), auth=writer()) as tx:
            await tx.warmup(descriptor_id=DESC_ID)
            assert len(rx._conns) == 1 and not rx._unauthenticated
            await asyncio.sleep(2.0)
            assert not rx._conns  # closed as idle
            await transfer(rx, tx, [3], seed=6)  # a new endpoint, transparently
            assert len(rx._conns) == 1

            class SlowSender(KVSender):
                async def _send_data(self, *args: Any, **kwargs: Any) -> None:
                    await asyncio.sleep(2.0)  # twice the idle limit between accept and data
                    await super()._send_data(*args, **kwargs)

        async with SlowSender(LAYOUT, resolver(rx), auth=writer(), shm=False) as slow:
            await transfer(rx, slow, [4, 5], seed=7)


async def test_sender_replaces_an_endpoint_idle_longer_than_its_limit(rx: KVReceiver) -> None:
    async with KVSender(LAYOUT, resolver(rx), auth=writer(), max_idle_s=0.3) as tx:
        await tx.warmup(descriptor_id=DESC_ID)
        (first,) = tx._peers.values()
        await asyncio.sleep(0.5)
        await transfer(rx, tx, [6], seed=8)
        (second,) = tx._peers.values()
        assert second is not first and first.ep.closed


# --------------------------------------------------------------------------- integrity


class TamperingSender(KVSender):
    """Signs the true digests, then sends the runs with one byte flipped: what an attacker on
    the path (or a corrupting link) would deliver. Over UCX: the same-host staging ring
    carries no digests (kvxfer.shm says why)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, shm=False, **kwargs)

    async def _send_data(self, peer: Any, seq: int, src: PoolBytes,
                         runs: list[tuple[int, int, int]], transfer_id: str,
                         timeout_s: float) -> None:
        altered = src.tensor.clone()
        start = runs[-1][0]
        altered[start].view(-1).view(torch.uint8)[12345] ^= 0x40
        await super()._send_data(peer, seq, PoolBytes(altered, self.layout), runs, transfer_id,
                                 timeout_s)


@pytest.mark.parametrize("signed", [True, False])
async def test_bytes_altered_in_flight_are_refused(signed: bool) -> None:
    """The transfer fails with ``kv_integrity_failed`` on both ends, its Expectation raises
    (the decode worker then fences and frees the blocks as after any failure, and never
    admits the request), and a clean transfer to the same blocks goes through after it."""
    async with KVReceiver(pool(1), LAYOUT, DESC_ID, auth=receiver_auth() if signed else None,
                          fence_grace_s=0.1) as rx:
        auth = writer() if signed else None
        xid = uuid.uuid4().hex
        landed = rx.expect(xid, [8, 9, 11], timeout_s=10)
        async with TamperingSender(LAYOUT, resolver(rx), auth=auth) as tx:
            with pytest.raises(KVTransferError) as failed:
                await tx.send(DESC_ID, pool(3), [0, 1, 2], [8, 9, 11], xid, 10,
                              notice={"first_token": 1})
        assert failed.value.code == ErrorCode.KV_INTEGRITY_FAILED
        with pytest.raises(KVTransferError) as outcome:
            await landed
        assert outcome.value.code == ErrorCode.KV_INTEGRITY_FAILED
        assert "altered in flight" in outcome.value.message
        assert not rx._transfers  # finished (fenced): nothing may land in them any more
        async with KVSender(LAYOUT, resolver(rx), auth=auth) as clean:
            await transfer(rx, clean, [8, 9, 11], seed=3)


async def test_a_signed_write_must_carry_digests(rx: KVReceiver) -> None:
    """A receiver with a secret refuses a signed write without digests (the signature would
    then say nothing about the bytes); a receiver without one takes it (no digests, no
    check: `KVSender(integrity=False)` without auth)."""
    xid = uuid.uuid4().hex
    landed = rx.expect(xid, [1], timeout_s=10)
    host, port = host_port(rx)
    frame = writer().sign({"op": "write", "seq": 1, "transfer_id": xid,
                           "descriptor_id": DESC_ID, "layout": LAYOUT.to_wire(),
                           "runs": [[1, 1]], "notice": None})
    ep = await ucxx.create_endpoint(host, port)
    try:
        await send_frame(ep, CTRL_TAG, frame, 5)
        reply = await recv_frame(ep, reply_tag(1), 5)
        assert reply["op"] == "reject" and reply["code"] == ErrorCode.KV_PROTOCOL_ERROR
        assert "digests" in reply["message"]
    finally:
        ep.abort()
    with pytest.raises(KVTransferError):
        await landed
    async with KVReceiver(pool(1), LAYOUT, DESC_ID) as open_rx:
        async with KVSender(LAYOUT, resolver(open_rx), integrity=False) as tx:
            await transfer(open_rx, tx, [2, 3], seed=9)


async def test_a_decode_worker_never_admits_altered_kv_and_frees_its_blocks(
        make_engine: Any, prompt_ids: list[list[int]]) -> None:
    """The whole decode side (real engine, DecodeWorker, signed KVReceiver): the remote
    request whose KV was altered in flight fails with ``kv_integrity_failed`` before a single
    token, is never admitted into the batch, and every block it held is free again."""
    from decode_svc.worker import DecodeWorker
    from pdserve.engine.async_engine import AsyncEngine
    from pdserve.handover import FirstToken
    from pdserve.kv_layout import KVDestination
    from pdserve.types import GenerateRequest, SamplingParams

    async with AsyncEngine(make_engine()) as engine, \
            KVReceiver(engine.kv_pool, engine.layout, DESC_ID, auth=receiver_auth(),
                       fence_grace_s=0.1) as rx:
        layout = engine.layout
        worker = DecodeWorker(engine, rx, worker_id="decode-a")
        req = GenerateRequest("altered-1", tuple(prompt_ids[0]), SamplingParams(max_tokens=4))
        stream = worker.allocate_and_generate(req)  # the path the router's stream takes
        slot = await anext(stream)
        assert isinstance(slot, KVDestination)
        dst = list(slot.block_ids[slot.num_cached_tokens // layout.block_size:])
        assert engine.last_stats.free_blocks < engine.last_stats.total_blocks
        src = torch.randn(layout.shape, generator=torch.Generator().manual_seed(3))

        async def resolve(descriptor_id: str) -> KVDescriptor | None:
            return KVDescriptor(DESC_ID, "decode-a", 5, rx.address, layout)

        async with TamperingSender(layout, resolve, auth=writer()) as tx:
            with pytest.raises(KVTransferError) as sent:
                await tx.send(DESC_ID, src, list(range(len(dst))), dst, slot.transfer_id, 10,
                              notice=FirstToken(5).to_notice())
        assert sent.value.code == ErrorCode.KV_INTEGRITY_FAILED
        with pytest.raises(KVTransferError) as failed:
            async for _ in stream:
                pytest.fail("a token came from KV that failed its digest")
        assert failed.value.code == ErrorCode.KV_INTEGRITY_FAILED
        assert await worker.drained(10)
        for _ in range(200):  # the engine thread publishes its stats after the abort
            if engine.last_stats.free_blocks == engine.last_stats.total_blocks:
                break
            await asyncio.sleep(0.05)
        assert engine.last_stats.free_blocks == engine.last_stats.total_blocks
        assert engine.last_stats.running == 0

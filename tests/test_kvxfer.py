"""KV block transfer over real UCX endpoints on loopback."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest
import torch

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

import ucxx

from kvxfer import KVReceiver, KVSender, expand_runs, merge_pairs, merge_runs
from kvxfer.protocol import CTRL_TAG, data_tag, recv_frame, reply_tag, send_frame
from kvxfer.runs import split_runs
from pdserve.control import KVDescriptor, WorkerRegistry, make_descriptor_id
from pdserve.errors import ErrorCode, KVTransferError
from pdserve.kv_layout import KVLayout

# 64 KiB blocks: large enough that UCX uses its rendezvous (zero-copy) protocol.
LAYOUT = KVLayout(
    num_blocks=32,
    num_layers=2,
    block_size=16,
    num_kv_heads=4,
    head_dim=64,
    dtype="float32",
    model_id="tiny",
)
DESC_ID = make_descriptor_id("d0", 2)


def random_pool(layout: KVLayout = LAYOUT, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(layout.shape, generator=gen, dtype=torch.float32)


def test_layout_geometry_and_its_one_codec() -> None:
    pool = random_pool()
    assert tuple(pool.shape) == LAYOUT.shape
    assert LAYOUT.block_nbytes == pool[0].numel() * pool.element_size() == 64 << 10
    assert LAYOUT.pool_nbytes == pool.numel() * pool.element_size()
    fit = KVLayout.for_budget(5 * LAYOUT.block_nbytes + 1, num_layers=2, block_size=16,
                              num_kv_heads=4, head_dim=64, dtype="float32", model_id="tiny")
    assert fit == replace(LAYOUT, num_blocks=5)
    # Descriptors (JSON) and protos (attributes) read the same wire form the same way.
    desc = KVDescriptor(DESC_ID, "d0", 2, "127.0.0.1:1", LAYOUT)
    assert KVDescriptor.from_json(desc.to_json()) == desc
    assert KVLayout.from_wire(LAYOUT.to_wire()) == LAYOUT

    class Msg:
        pass

    msg = Msg()
    msg.__dict__.update(LAYOUT.to_wire())
    assert KVLayout.from_wire(msg) == LAYOUT
    for bad in (None, [], {**LAYOUT.to_wire(), "dtype": "int4"},
                {**LAYOUT.to_wire(), "num_blocks": -1}, {**LAYOUT.to_wire(), "head_dim": True},
                {k: v for k, v in LAYOUT.to_wire().items() if k != "model_id"}):
        with pytest.raises(ValueError):
            KVLayout.from_wire(bad)


class Resolver:
    """Descriptor lookup that counts calls, standing in for WorkerRegistry.get_descriptor."""

    def __init__(self) -> None:
        self.descriptors: dict[str, KVDescriptor] = {}
        self.calls = 0

    def add(self, desc: KVDescriptor) -> None:
        self.descriptors[desc.descriptor_id] = desc

    async def __call__(self, descriptor_id: str) -> KVDescriptor | None:
        self.calls += 1
        return self.descriptors.get(descriptor_id)


@pytest.fixture
def dst_pool() -> torch.Tensor:
    return random_pool(seed=1)


@pytest.fixture
def src_pool() -> torch.Tensor:
    return random_pool(seed=2)


@pytest.fixture
async def receiver(dst_pool: torch.Tensor) -> AsyncIterator[KVReceiver]:
    async with KVReceiver(dst_pool, LAYOUT, DESC_ID, fence_grace_s=0.1) as rx:
        yield rx


@pytest.fixture
def resolver(receiver: KVReceiver) -> Resolver:
    res = Resolver()
    res.add(KVDescriptor(DESC_ID, "d0", 2, receiver.address, LAYOUT))
    return res


@pytest.fixture(params=[True, False], ids=["shm", "ucx"])
async def sender(resolver: Resolver, request: pytest.FixtureRequest) -> AsyncIterator[KVSender]:
    """Both data paths: the same-host staging ring (kvxfer.shm) and UCX."""
    async with KVSender(LAYOUT, resolver, shm=request.param) as tx:
        yield tx


def tid() -> str:
    return uuid.uuid4().hex


# --------------------------------------------------------------------------- runs


def test_merge_runs() -> None:
    assert merge_runs([]) == []
    assert merge_runs([4, 5, 6, 9, 2, 3]) == [(4, 3), (9, 1), (2, 2)]
    assert merge_runs([1, 1, 2]) == [(1, 1), (1, 2)]
    assert expand_runs(merge_runs([7, 8, 0, 1, 2, 5])) == [7, 8, 0, 1, 2, 5]


def test_merge_pairs_needs_both_sides_consecutive() -> None:
    assert merge_pairs([0, 1, 2], [7, 8, 3]) == [(0, 7, 2), (2, 3, 1)]
    assert merge_pairs([0, 1, 2, 3], [4, 5, 6, 7]) == [(0, 4, 4)]
    assert merge_pairs([5, 4], [0, 1]) == [(5, 0, 1), (4, 1, 1)]
    with pytest.raises(ValueError):
        merge_pairs([1], [])


def test_split_runs_keeps_the_copy() -> None:
    """Runs cut into pieces (kvxfer sends digested runs in pieces of at most 8 MiB) still
    copy every source block to its destination."""
    runs = merge_pairs([0, 1, 2, 3, 4, 9], [7, 8, 9, 10, 11, 1])
    pieces = split_runs(runs, 2)
    assert pieces == [(0, 7, 2), (2, 9, 2), (4, 11, 1), (9, 1, 1)]
    assert [(s + i, d + i) for s, d, n in pieces for i in range(n)] == \
        [(s + i, d + i) for s, d, n in runs for i in range(n)]
    assert split_runs(runs, 100) == runs
    with pytest.raises(ValueError):
        split_runs(runs, 0)


# --------------------------------------------------------------------------- transfers


async def test_noncontiguous_transfer(
    receiver: KVReceiver, sender: KVSender, src_pool: torch.Tensor, dst_pool: torch.Tensor
) -> None:
    before = dst_pool.clone()
    src_ids = [3, 4, 5, 10, 20, 21]
    dst_ids = [0, 1, 2, 7, 30, 31]
    xid = tid()
    landed = receiver.expect(xid, dst_ids, timeout_s=10)
    notice = {"first_token": 42, "logprob": -0.5}
    result = await sender.send(DESC_ID, src_pool, src_ids, dst_ids, xid, 10, notice=notice)
    assert await landed == notice  # the writer's notice arrives with the blocks
    assert result.num_runs == 3 and result.nbytes == 6 * LAYOUT.block_nbytes
    assert torch.equal(dst_pool[dst_ids], src_pool[src_ids])
    untouched = [b for b in range(LAYOUT.num_blocks) if b not in dst_ids]
    assert torch.equal(dst_pool[untouched], before[untouched])


async def test_a_transfer_in_parts_lands_with_its_last_write(
    receiver: KVReceiver, sender: KVSender, src_pool: torch.Tensor, dst_pool: torch.Tensor
) -> None:
    """Issue 19 item 1: parts (each computed chunk's blocks) then the last write, which
    carries the notice and may send again a block a part sent (after a preemption)."""
    src_ids, dst_ids = [3, 4, 5, 10, 11, 20], [0, 1, 2, 7, 8, 30]
    xid = tid()
    landed = receiver.expect(xid, dst_ids, timeout_s=10)
    await sender.send(DESC_ID, src_pool, src_ids[:2], dst_ids[:2], xid, 10, part=True)
    await sender.send(DESC_ID, src_pool, src_ids[2:4], dst_ids[2:4], xid, 10, part=True)
    await asyncio.sleep(0.05)
    assert not landed.done()  # no part completes it
    assert torch.equal(dst_pool[dst_ids[:4]], src_pool[src_ids[:4]])
    with pytest.raises(KVTransferError, match="notice") as info:
        await sender.send(DESC_ID, src_pool, src_ids[4:], dst_ids[4:], xid, 10,
                          notice={"first_token": 1}, part=True)
    assert info.value.code == ErrorCode.KV_INVALID_ARGUMENT  # refused before anything is sent
    await sender.send(DESC_ID, src_pool, src_ids[3:], dst_ids[3:], xid, 10,
                      notice={"first_token": 7})
    assert await landed == {"first_token": 7}
    assert torch.equal(dst_pool[dst_ids], src_pool[src_ids])


async def test_a_last_write_that_leaves_a_block_unwritten_fails_the_transfer(
    receiver: KVReceiver, sender: KVSender, src_pool: torch.Tensor
) -> None:
    xid = tid()
    landed = receiver.expect(xid, [0, 1, 2, 3], timeout_s=10)
    await sender.send(DESC_ID, src_pool, [5, 6], [0, 1], xid, 10, part=True)
    with pytest.raises(KVTransferError, match="2 landed") as info:
        await sender.send(DESC_ID, src_pool, [8], [3], xid, 10)  # block 2 never written
    assert info.value.code == ErrorCode.KV_BLOCK_MISMATCH
    with pytest.raises(KVTransferError, match="expects blocks"):
        await landed
    xid = tid()
    landed = receiver.expect(xid, [4, 5], timeout_s=10)
    with pytest.raises(KVTransferError) as info:  # a part outside the expected blocks
        await sender.send(DESC_ID, src_pool, [5, 6], [5, 6], xid, 10, part=True)
    assert info.value.code == ErrorCode.KV_BLOCK_MISMATCH
    with pytest.raises(KVTransferError):
        await landed


async def test_between_parts_cancel_and_deadline_end_the_transfer_at_once(
    receiver: KVReceiver, sender: KVSender, src_pool: torch.Tensor, dst_pool: torch.Tensor
) -> None:
    xid = tid()
    landed = receiver.expect(xid, [0, 1, 2], timeout_s=10)
    await sender.send(DESC_ID, src_pool, [5], [0], xid, 10, part=True)
    t0 = time.monotonic()
    await receiver.cancel(xid)  # nothing is on its way between parts: no fence to wait for
    assert time.monotonic() - t0 < 1.0
    with pytest.raises(KVTransferError) as info:
        await landed
    assert info.value.code == ErrorCode.KV_CANCELLED
    before = dst_pool.clone()
    with pytest.raises(KVTransferError, match="already failed") as info:
        await sender.send(DESC_ID, src_pool, [6, 7], [1, 2], xid, 10)
    assert info.value.code == ErrorCode.KV_UNKNOWN_TRANSFER
    assert torch.equal(dst_pool, before)
    xid = tid()
    landed = receiver.expect(xid, [3, 4], timeout_s=0.5)  # the deadline spans every part
    await sender.send(DESC_ID, src_pool, [5], [3], xid, 10, part=True)
    with pytest.raises(KVTransferError, match="last part did not arrive") as info:
        await landed
    assert info.value.code == ErrorCode.KV_TIMEOUT
    assert xid not in receiver._transfers


async def test_each_part_that_lands_renews_the_timeout_up_to_max_s(
    receiver: KVReceiver, sender: KVSender, src_pool: torch.Tensor, dst_pool: torch.Tensor
) -> None:
    """A writer that keeps making progress is not cut off at the first deadline: each part
    that lands gives the next one `timeout_s` again, but never past `max_s`."""
    xid = tid()
    landed = receiver.expect(xid, [3, 4, 5], timeout_s=1.0, max_s=30)
    await sender.send(DESC_ID, src_pool, [10], [3], xid, 10, part=True)
    await asyncio.sleep(0.7)
    await sender.send(DESC_ID, src_pool, [11], [4], xid, 10, part=True)
    await asyncio.sleep(0.7)  # past the first deadline, within the renewed one
    await sender.send(DESC_ID, src_pool, [12], [5], xid, 10)
    await landed
    assert torch.equal(dst_pool[3:6], src_pool[10:13])
    with pytest.raises(KVTransferError, match="max_s") as info:
        receiver.expect(tid(), [6], timeout_s=2.0, max_s=1.0)
    assert info.value.code == ErrorCode.KV_INVALID_ARGUMENT
    xid = tid()
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    landed = receiver.expect(xid, [6, 7, 8], timeout_s=1.0, max_s=1.2)
    await sender.send(DESC_ID, src_pool, [10], [6], xid, 10, part=True)
    await sender.send(DESC_ID, src_pool, [11], [7], xid, 10, part=True)
    assert receiver._transfers[xid].deadline <= t0 + 1.2 + 1e-6  # renewed, up to max_s
    with pytest.raises(KVTransferError, match="2 blocks landed") as info:
        await landed
    assert info.value.code == ErrorCode.KV_TIMEOUT


async def test_concurrent_transfers_share_one_endpoint(
    receiver: KVReceiver, sender: KVSender, src_pool: torch.Tensor, dst_pool: torch.Tensor
) -> None:
    await sender.warmup(descriptor_id=DESC_ID)
    jobs = [([i, i + 8], [31 - i, 20 - i]) for i in range(6)]
    ids = [tid() for _ in jobs]
    landed = [receiver.expect(x, dst, 10) for x, (_, dst) in zip(ids, jobs, strict=True)]
    await asyncio.gather(
        *(
            sender.send(DESC_ID, src_pool, src, dst, x, 10)
            for x, (src, dst) in zip(ids, jobs, strict=True)
        ),
        *landed,
    )
    for src, dst in jobs:
        assert torch.equal(dst_pool[dst], src_pool[src])
    assert len(sender._peers) == 1


async def test_warmup_opens_the_endpoint_used_by_send(
    receiver: KVReceiver, sender: KVSender, src_pool: torch.Tensor
) -> None:
    await sender.warmup(address=receiver.address)
    (peer,) = sender._peers.values()
    xid = tid()
    landed = receiver.expect(xid, [0], 10)
    await sender.send(DESC_ID, src_pool, [1], [0], xid, 10)
    assert await landed is None  # no notice sent
    assert list(sender._peers.values()) == [peer]
    with pytest.raises(KVTransferError) as info:
        await sender.send(DESC_ID, src_pool, [1], [0], tid(), 10, notice={"x": object()})
    assert info.value.code == ErrorCode.KV_INVALID_ARGUMENT


async def test_registry_published_descriptor(
    redis_server: str,
    receiver: KVReceiver,
    src_pool: torch.Tensor,
    dst_pool: torch.Tensor,
) -> None:
    namespace = f"t{uuid.uuid4().hex[:12]}"
    async with WorkerRegistry.from_url(redis_server, namespace=namespace) as registry:
        await registry.publish_descriptor(DESC_ID, LAYOUT, receiver.address, "d0", 2, ttl_s=30)
        async with KVSender(LAYOUT, registry.get_descriptor) as tx:
            xid = tid()
            landed = receiver.expect(xid, [5, 6], 10)
            await tx.send(DESC_ID, src_pool, [0, 1], [5, 6], xid, 10)
            await landed
    assert torch.equal(dst_pool[[5, 6]], src_pool[[0, 1]])


# --------------------------------------------------------------------------- rejections


async def test_stale_epoch_is_rejected_before_any_byte_moves(
    receiver: KVReceiver, resolver: Resolver, sender: KVSender, src_pool: torch.Tensor
) -> None:
    # The worker restarted on the same address: epoch 1's descriptor now reaches epoch 2's pool.
    stale_id = make_descriptor_id("d0", 1)
    resolver.add(KVDescriptor(stale_id, "d0", 1, receiver.address, LAYOUT))
    xid = tid()
    landed = receiver.expect(xid, [0, 1], 10)
    before = receiver._pool.tensor.clone()
    with pytest.raises(KVTransferError, match="restarted") as info:
        await sender.send(stale_id, src_pool, [4, 5], [0, 1], xid, 10)
    assert info.value.code == ErrorCode.KV_STALE_DESCRIPTOR
    assert torch.equal(receiver._pool.tensor, before)
    assert not landed.done()  # the transfer may still come from a writer with the right id
    calls = resolver.calls
    with pytest.raises(KVTransferError):
        await sender.send(stale_id, src_pool, [4, 5], [0, 1], xid, 10)
    assert resolver.calls == calls + 1  # the stale cache entry was dropped
    await sender.send(DESC_ID, src_pool, [4, 5], [0, 1], xid, 10)
    await landed


async def test_out_of_range_blocks(
    receiver: KVReceiver, resolver: Resolver, sender: KVSender, src_pool: torch.Tensor
) -> None:
    with pytest.raises(KVTransferError, match="outside the pool") as info:
        await sender.send(DESC_ID, src_pool, [0], [LAYOUT.num_blocks], tid(), 10)
    assert info.value.code == ErrorCode.KV_BLOCK_OUT_OF_RANGE
    with pytest.raises(KVTransferError, match="source block") as info:
        await sender.send(DESC_ID, src_pool, [-1], [0], tid(), 10)
    assert info.value.code == ErrorCode.KV_INVALID_ARGUMENT
    assert sender._peers == {}  # rejected locally, before connecting

    # A descriptor that lies about the pool size gets past the sender; the receiver refuses.
    big = replace(LAYOUT, num_blocks=64)
    resolver.add(KVDescriptor(DESC_ID, "d0", 2, receiver.address, big))
    sender.forget_descriptor(DESC_ID)
    xid = tid()
    landed = receiver.expect(xid, [1], 10)
    before = receiver._pool.tensor.clone()
    with pytest.raises(KVTransferError, match="outside the pool") as info:
        await sender.send(DESC_ID, src_pool, [0], [40], xid, 10)
    assert info.value.code == ErrorCode.KV_BLOCK_OUT_OF_RANGE
    assert torch.equal(receiver._pool.tensor, before)
    with pytest.raises(KVTransferError) as info:
        await landed
    assert info.value.code == ErrorCode.KV_BLOCK_OUT_OF_RANGE


async def test_unexpected_blocks_and_transfers(
    receiver: KVReceiver, sender: KVSender, src_pool: torch.Tensor
) -> None:
    with pytest.raises(KVTransferError, match="not expected") as info:
        await sender.send(DESC_ID, src_pool, [0], [0], "never-expected", 10)
    assert info.value.code == ErrorCode.KV_UNKNOWN_TRANSFER
    xid = tid()
    landed = receiver.expect(xid, [2, 3], 10)
    with pytest.raises(KVTransferError, match="expects blocks") as info:
        await sender.send(DESC_ID, src_pool, [0, 1], [3, 4], xid, 10)
    assert info.value.code == ErrorCode.KV_BLOCK_MISMATCH
    with pytest.raises(KVTransferError, match="expects blocks"):
        await landed


async def test_layout_mismatch(
    receiver: KVReceiver, resolver: Resolver, sender: KVSender, src_pool: torch.Tensor
) -> None:
    other_model = replace(LAYOUT, model_id="other")
    async with KVSender(other_model, resolver) as tx:
        with pytest.raises(KVTransferError, match="not compatible") as info:
            await tx.send(DESC_ID, src_pool, [0], [0], tid(), 10)
        assert info.value.code == ErrorCode.KV_LAYOUT_MISMATCH
        assert tx._peers == {}

    # A descriptor that lies about the receiver's layout gets past the sender; the receiver
    # still refuses, and fails the transfer it was meant for.
    xid = tid()
    landed = receiver.expect(xid, [0], 10)
    resolver.add(KVDescriptor(DESC_ID, "d0", 2, receiver.address, other_model))
    async with KVSender(other_model, resolver) as tx:
        with pytest.raises(KVTransferError, match="not compatible") as info:
            await tx.send(DESC_ID, src_pool, [0], [0], xid, 10)
        assert info.value.code == ErrorCode.KV_LAYOUT_MISMATCH
    with pytest.raises(KVTransferError, match="not compatible"):
        await landed


# --------------------------------------------------------------------------- timeouts


async def test_expectation_times_out_without_writer(receiver: KVReceiver) -> None:
    start = time.monotonic()
    with pytest.raises(KVTransferError, match="no writer") as info:
        await receiver.expect(tid(), [0], timeout_s=0.3)
    assert info.value.code == ErrorCode.KV_TIMEOUT
    assert time.monotonic() - start < 2


@pytest.mark.parametrize("shm", [True, False])
async def test_send_times_out_when_receiver_never_answers(
    resolver: Resolver, src_pool: torch.Tensor, shm: bool
) -> None:
    """Given up on while opening the endpoint (shm: the same-host handshake) or while waiting
    for the request's reply (no shm), the endpoint is closed, not kept for the next transfer
    with its control stream out of step."""
    held = []

    async def silent(ep: object) -> None:
        held.append(ep)  # accept the connection, never read from it

    listener = ucxx.create_listener(silent, port=0)
    resolver.add(KVDescriptor("mute:1", "mute", 1, f"127.0.0.1:{listener.port}", LAYOUT))
    async with KVSender(LAYOUT, resolver, shm=shm) as tx:
        start = time.monotonic()
        with pytest.raises(KVTransferError, match=r"within 0\.5s") as info:
            await tx.send("mute:1", src_pool, [0], [0], tid(), timeout_s=0.5)
        assert info.value.code == ErrorCode.KV_TIMEOUT
        assert time.monotonic() - start < 3
        assert f"127.0.0.1:{listener.port}" not in tx._peers
    listener.close()


async def test_unknown_descriptor_and_unreachable_receiver(
    resolver: Resolver, sender: KVSender, src_pool: torch.Tensor
) -> None:
    with pytest.raises(KVTransferError, match="does not exist") as info:
        await sender.send("nobody:1", src_pool, [0], [0], tid(), 5)
    assert info.value.code == ErrorCode.KV_DESCRIPTOR_NOT_FOUND
    resolver.add(KVDescriptor("gone:1", "gone", 1, "127.0.0.1:1", LAYOUT))
    with pytest.raises(KVTransferError) as info:
        await sender.send("gone:1", src_pool, [0], [0], tid(), 5)
    assert info.value.code == ErrorCode.KV_CONNECT_FAILED


# --------------------------------------------------------------------------- cancel fence


async def test_cancel_pending_transfer(
    receiver: KVReceiver, sender: KVSender, src_pool: torch.Tensor, dst_pool: torch.Tensor
) -> None:
    xid = tid()
    landed = receiver.expect(xid, [0, 1], 10)
    await receiver.cancel(xid)
    with pytest.raises(KVTransferError) as info:
        await landed
    assert info.value.code == ErrorCode.KV_CANCELLED
    before = dst_pool.clone()
    with pytest.raises(KVTransferError, match="already failed") as info:
        await sender.send(DESC_ID, src_pool, [4, 5], [0, 1], xid, 10)
    assert info.value.code == ErrorCode.KV_UNKNOWN_TRANSFER
    assert torch.equal(dst_pool, before)


async def test_cancel_fences_posted_receives(
    receiver: KVReceiver, src_pool: torch.Tensor, dst_pool: torch.Tensor
) -> None:
    """A writer was accepted (recvs are posted into the pool) but its data is late: cancel()
    must return only once those recvs can no longer write, and data sent afterwards must not
    land.
    """
    host, port = receiver.address.rsplit(":", 1)
    ep = await ucxx.create_endpoint(host, int(port))
    xid = tid()
    landed = receiver.expect(xid, [8, 9], 10)
    write = {
        "op": "write",
        "seq": 1,
        "transfer_id": xid,
        "descriptor_id": DESC_ID,
        "layout": LAYOUT.__dict__,
        "runs": [[8, 2]],
    }
    await send_frame(ep, CTRL_TAG, write, 5)
    assert (await recv_frame(ep, reply_tag(1), 5))["op"] == "accept"
    before = dst_pool.clone()

    start = time.monotonic()
    await receiver.cancel(xid)
    assert time.monotonic() - start < 5
    with pytest.raises(KVTransferError) as info:
        await landed
    assert info.value.code == ErrorCode.KV_CANCELLED

    # The late data must not land: the receiver aborted the endpoint to fence its recvs.
    late = src_pool[0:2].contiguous().view(-1).view(torch.uint8).numpy()
    try:
        await asyncio.wait_for(ep.send(late, tag=data_tag(1, 0)), 2)
    except (ucxx.exceptions.UCXError, TimeoutError):
        pass
    await asyncio.sleep(0.3)
    assert torch.equal(dst_pool, before)
    ep.abort()


async def test_receiver_restart(resolver: Resolver, src_pool: torch.Tensor) -> None:
    """A decode worker restarts with a new epoch (and port): the sender's cached descriptor
    and endpoint for the old incarnation fail cleanly, then are forgotten.
    """
    old_id, new_id = make_descriptor_id("d5", 1), make_descriptor_id("d5", 2)
    pool = random_pool(seed=5)
    # Right after close, ucxx may still be tearing the old listener down: connecting to it
    # then waits for the connect timeout instead of being refused, so keep that short.
    async with KVSender(LAYOUT, resolver, connect_timeout_s=1.0) as tx:
        async with KVReceiver(pool, LAYOUT, old_id) as old:
            resolver.add(KVDescriptor(old_id, "d5", 1, old.address, LAYOUT))
            xid = tid()
            landed = old.expect(xid, [0], 10)
            await tx.send(old_id, src_pool, [3], [0], xid, 10)
            await landed
        async with KVReceiver(pool, LAYOUT, new_id) as new:
            resolver.add(KVDescriptor(new_id, "d5", 2, new.address, LAYOUT))
            xid = tid()
            landed = new.expect(xid, [1], 10)
            with pytest.raises(KVTransferError) as info:
                await tx.send(old_id, src_pool, [4], [1], xid, 10)
            assert info.value.code == ErrorCode.KV_CONNECT_FAILED
            del resolver.descriptors[old_id]  # the old lease is gone from the registry
            with pytest.raises(KVTransferError) as info:
                await tx.send(old_id, src_pool, [4], [1], xid, 10)
            assert info.value.code == ErrorCode.KV_DESCRIPTOR_NOT_FOUND
            await tx.send(new_id, src_pool, [4], [1], xid, 10)
            await landed
    assert torch.equal(pool[[0, 1]], src_pool[[3, 4]])

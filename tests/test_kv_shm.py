"""The same-host KV paths (issue 19 item 2): a single copy by cross-memory attach
(kvxfer.cma), else a staging ring per prefill peer (kvxfer.shm).

- they are detected, not assumed: another host's boot id, memory that cannot be read back, a
  staging file that cannot be opened, or `shm=False` on either end each fall back (cma ->
  ring -> UCX); the ring's file is private (0600) and gone from /dev/shm once attached;
- bytes land exactly on both paths (contiguous, scattered, many transfers sharing one ring,
  signed);
- a bad chunk frame fails the transfer, fenced; a stray write into the staging ring after a
  transfer failed never reaches the pool;
- a peer killed mid-transfer (the receiver, then the sender, each in its own process): the
  other end gets a clear ``kv_peer_gone`` at once, nothing lands after the failure, the decode
  worker never admits the request and frees every block, and no staging file is left.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

from kvxfer import KVReceiver, KVSender, cma, shm
from kvxfer.auth import KVAuth
from pdserve.control import KVDescriptor, make_descriptor_id
from pdserve.errors import ErrorCode, KVTransferError
from pdserve.kv_layout import KVLayout

pytestmark = pytest.mark.timeout(240)

LAYOUT = KVLayout(num_blocks=32, num_layers=2, block_size=16, num_kv_heads=4, head_dim=64,
                  dtype="float32", model_id="tiny")
DESC_ID = make_descriptor_id("decode-s", 1)
KEY = b"shm-test-kv-key-0123456789abcdef"
PEER_MODULE = "tests.helpers.kv_shm_peer"  # run with `-m` from the repository root
REPO = Path(__file__).resolve().parents[1]


def pool(seed: int) -> torch.Tensor:
    return torch.randn(LAYOUT.shape, generator=torch.Generator().manual_seed(seed))


def staging_files() -> set[str]:
    return {p.name for p in shm.SHM_DIR.glob("pdserve-kv-*")}


async def _anyone(_: str) -> bool:
    return True


def resolver(address: str, layout: KVLayout = LAYOUT, desc_id: str = DESC_ID) -> Any:
    async def resolve(descriptor_id: str) -> KVDescriptor | None:
        return KVDescriptor(desc_id, desc_id.rpartition(":")[0], 1, address, layout) \
            if descriptor_id == desc_id else None
    return resolve


@pytest.fixture
async def rx() -> AsyncIterator[KVReceiver]:
    """A receiver offering only staging rings (no cross-memory attach)."""
    async with KVReceiver(pool(1), LAYOUT, DESC_ID, auth=KVAuth(KEY, authorize_sender=_anyone),
                          fence_grace_s=0.1, shm_slot_bytes=3 * LAYOUT.block_nbytes // 2,
                          shm_slots=2, shm_cma=False) as receiver:
        yield receiver


def signed() -> KVAuth:
    return KVAuth(KEY, sender_id="prefill-s")


def ring_of(tx: KVSender) -> Any:
    (peer,) = tx._peers.values()
    return peer.ring


def path_of(tx: KVSender) -> str:
    (peer,) = tx._peers.values()
    return "cma" if peer.cma else "ring" if peer.ring is not None else "ucx"


async def test_cross_memory_attach_is_the_default_and_lands_exactly() -> None:
    src = pool(7)
    async with KVReceiver(pool(1), LAYOUT, DESC_ID, auth=KVAuth(KEY, authorize_sender=_anyone)
                          ) as rx, \
            KVSender(LAYOUT, resolver(rx.address), auth=signed()) as tx:
        for src_ids, dst_ids in ([list(range(12)), list(range(12, 24))], [[9, 2, 30], [4, 31, 0]]):
            xid = uuid.uuid4().hex
            landed = rx.expect(xid, dst_ids, timeout_s=10)
            await tx.send(DESC_ID, src, src_ids, dst_ids, xid, 10, notice={"k": 1})
            assert await landed == {"k": 1}
            assert torch.equal(rx._pool.tensor[dst_ids], src[src_ids])
        assert path_of(tx) == "cma"


async def test_transfers_through_the_ring_land_exactly(rx: KVReceiver) -> None:
    before = staging_files()
    src = pool(2)
    async with KVSender(LAYOUT, resolver(rx.address), auth=signed()) as tx:
        await tx.warmup(descriptor_id=DESC_ID)
        ring = ring_of(tx)
        assert ring is not None  # detected: same boot id, the file opened and matched
        assert not staging_files() - before  # unlinked once both ends mapped it
        cases = [([0, 1, 2, 3, 4], [10, 11, 12, 13, 14]), ([7, 3, 9], [20, 5, 30]), ([6], [0])]
        for src_ids, dst_ids in cases:
            xid = uuid.uuid4().hex
            landed = rx.expect(xid, dst_ids, timeout_s=10)
            await tx.send(DESC_ID, src, src_ids, dst_ids, xid, 10, notice={"n": len(src_ids)})
            assert await landed == {"n": len(src_ids)}
            assert torch.equal(rx._pool.tensor[dst_ids], src[src_ids])
        # Many at once share the ring's two slots.
        xids = [uuid.uuid4().hex for _ in range(8)]
        waits = [rx.expect(x, [16 + i], timeout_s=10) for i, x in enumerate(xids)]
        await asyncio.gather(*(tx.send(DESC_ID, src, [i], [16 + i], x, 10)
                               for i, x in enumerate(xids)))
        await asyncio.gather(*waits)
        assert torch.equal(rx._pool.tensor[16:24], src[0:8])
        assert sorted(ring.free) == [0, 1]  # every credit came back
    for _ in range(100):
        if rx._rings is not None and rx._rings.count == 0:
            break
        await asyncio.sleep(0.02)
    assert rx._rings is not None and rx._rings.count == 0  # gone with the connection


def test_the_staging_file_is_private_and_checked(tmp_path: Path) -> None:
    ring = shm.Ring.create(2, 4096, directory=tmp_path)
    assert ring.path.stat().st_mode & 0o777 == 0o600
    args = (ring.path.name, ring.token.hex(), 2, 4096)
    shm.Ring.attach(*args, directory=tmp_path)
    with pytest.raises(ValueError, match="token"):
        shm.Ring.attach(ring.path.name, "00" * 32, 2, 4096, directory=tmp_path)
    with pytest.raises(ValueError, match="private"):
        shm.Ring.attach(ring.path.name, ring.token.hex(), 2, 8192, directory=tmp_path)
    ring.path.chmod(0o644)
    with pytest.raises(ValueError, match="private"):
        shm.Ring.attach(*args, directory=tmp_path)
    with pytest.raises(ValueError, match="name"):
        shm.Ring.attach("../etc/passwd", ring.token.hex(), 2, 4096, directory=tmp_path)
    ring.unlink()
    with pytest.raises(FileNotFoundError):
        shm.Ring.attach(*args, directory=tmp_path)


@pytest.mark.parametrize(("why", "path"), [("other host", "ucx"), ("memory unreadable", "ring"),
                                          ("unopenable", "ucx"), ("sender off", "ucx"),
                                          ("receiver off", "ucx")])
async def test_no_same_host_path_unless_detected(why: str, path: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Each reason falls back (cma -> ring -> UCX), where the bytes land as before."""
    if why == "memory unreadable":
        def denied(*args: Any) -> None:
            raise PermissionError("ptrace policy")
        monkeypatch.setattr("kvxfer.cma.read", denied)
    if why == "other host":
        monkeypatch.setattr("kvxfer.sender.host_id", lambda: "another-boot-id")
    if why == "unopenable":
        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise PermissionError("not here")
        monkeypatch.setattr(shm.Ring, "attach", refuse)
    before = staging_files()
    async with KVReceiver(pool(1), LAYOUT, DESC_ID, shm=why != "receiver off",
                          shm_cma=why != "unopenable") as rx:
        async with KVSender(LAYOUT, resolver(rx.address), shm=why != "sender off") as tx:
            xid = uuid.uuid4().hex
            landed = rx.expect(xid, [4, 5], timeout_s=10)
            await tx.send(DESC_ID, pool(3), [1, 2], [4, 5], xid, 10)
            await landed
            assert path_of(tx) == path
            assert torch.equal(rx._pool.tensor[[4, 5]], pool(3)[[1, 2]])
            assert rx._rings is None or rx._rings.count == (path == "ring")
    assert staging_files() == before


async def test_a_bad_chunk_frame_fails_the_transfer_fenced(rx: KVReceiver,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """A chunk frame naming the wrong slot (or forged) fails the transfer on both ends; a
    stray write into the staging ring afterwards never reaches the pool."""
    real = shm.ready_frame

    def wrong_slot(key: bytes | None, transfer_id: str, chunk: int, slot: int,
                   nbytes: int) -> bytes:
        return real(key, transfer_id, chunk, slot + 7, nbytes)

    monkeypatch.setattr(shm, "ready_frame", wrong_slot)
    xid = uuid.uuid4().hex
    landed = rx.expect(xid, [1, 2, 3], timeout_s=10)
    async with KVSender(LAYOUT, resolver(rx.address), auth=signed()) as tx:
        with pytest.raises(KVTransferError) as sent:
            await tx.send(DESC_ID, pool(4), [0, 1, 2], [1, 2, 3], xid, 10)
        assert sent.value.code == ErrorCode.KV_PROTOCOL_ERROR
        with pytest.raises(KVTransferError) as outcome:
            await landed
        assert outcome.value.code == ErrorCode.KV_PROTOCOL_ERROR
        after = rx._pool.tensor.clone()
        ring = ring_of(tx).ring
        for slot in range(ring.slots):
            ring.slot(slot)[:] = 0xFF  # the writer scribbles on the ring after the failure
        await asyncio.sleep(0.2)
        assert torch.equal(rx._pool.tensor, after)


# --------------------------------------------------------------------------- killed peers


def _peer(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", PEER_MODULE, *args], cwd=REPO,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


async def _line(proc: subprocess.Popen[str]) -> str:
    """The peer's next ``PEER ...`` line (its logs go to stdout too)."""
    assert proc.stdout is not None
    while True:
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)
        assert line, "the peer process exited early"
        if line.startswith("PEER "):
            return line.removeprefix("PEER ").strip()


@pytest.mark.parametrize("path", ["cma", "ring"])
async def test_receiver_killed_mid_transfer(path: str) -> None:
    """The sender's transfer fails at once with ``kv_peer_gone`` (the router then prefills
    locally), the endpoint and its ring are dropped, no staging file is left, and the next
    transfer goes to a new receiver."""
    before = staging_files()
    proc = _peer("receiver", path, json.dumps(LAYOUT.to_wire()))
    try:
        address = await _line(proc)
        desc = make_descriptor_id("shm-peer", 1)
        xid = uuid.uuid4().hex
        assert proc.stdin is not None
        proc.stdin.write(f"{xid} {','.join(str(i) for i in range(8, 16))}\n")
        proc.stdin.flush()
        src = pool(5)
        async with KVSender(LAYOUT, resolver(address, desc_id=desc)) as tx:
            await tx.warmup(descriptor_id=desc)
            assert path_of(tx) == path
            sending = asyncio.create_task(tx.send(desc, src, list(range(8)),
                                                  list(range(8, 16)), xid, 60))
            assert await _line(proc) == "copying"
            proc.send_signal(signal.SIGKILL)
            with pytest.raises(KVTransferError) as failed:
                await asyncio.wait_for(sending, 30)  # well before the transfer's 60 s
            assert failed.value.code == ErrorCode.KV_PEER_GONE
            assert not tx._peers  # dropped, ring and all
            assert torch.equal(src, pool(5))
    finally:
        proc.kill()
        proc.communicate()  # reaps it and closes its pipes
    assert staging_files() == before


@pytest.mark.parametrize("path", ["cma", "ring"])
async def test_sender_killed_mid_transfer(path: str, make_engine: Any,
                                          prompt_ids: list[list[int]],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole decode side (engine, DecodeWorker, KVReceiver with rings): the request fails
    with ``kv_peer_gone`` before a token, nothing lands in its blocks after the failure, it
    is never admitted, every block is free again and the ring is gone."""
    from decode_svc.worker import DecodeWorker
    from pdserve.engine.async_engine import AsyncEngine
    from pdserve.types import GenerateRequest, SamplingParams

    before = staging_files()
    copying = threading.Event()  # the cma path: our own reads of the sender's blocks
    real_read, calls = cma.read, itertools.count()

    def slow_read(*args: Any) -> None:
        if next(calls) >= 1:  # the first is the setup probe
            copying.set()
            time.sleep(0.3)
        real_read(*args)

    monkeypatch.setattr(cma, "read", slow_read)
    async with AsyncEngine(make_engine()) as engine:
        layout = engine.layout
        monkeypatch.setattr(cma, "PIECE_BYTES", layout.block_nbytes)
        async with KVReceiver(engine.kv_pool, layout, make_descriptor_id("shm-peer", 1),
                              fence_grace_s=0.1, shm_slot_bytes=layout.block_nbytes,
                              shm_slots=2, shm_cma=path == "cma") as rx:
            worker = DecodeWorker(engine, rx, worker_id="decode-s")
            req = GenerateRequest("killed-1", tuple(max(prompt_ids, key=len)),
                                  SamplingParams(max_tokens=4))
            slot = await worker.allocate_remote(req)
            dst = list(slot.block_ids[slot.num_cached_tokens // layout.block_size:])
            assert len(dst) >= 3, len(dst)
            proc = _peer("sender", path, json.dumps(layout.to_wire()), rx.address,
                         slot.transfer_id, ",".join(map(str, dst)))
            try:
                stream = asyncio.create_task(_drain(worker, req.request_id, slot.transfer_id))
                if path == "ring":
                    assert await _line(proc) == "copying"
                else:
                    assert await asyncio.to_thread(copying.wait, 60)
                proc.send_signal(signal.SIGKILL)
                with pytest.raises(KVTransferError) as failed:
                    await asyncio.wait_for(stream, 30)  # well before the KV wait's limit
                assert failed.value.code == ErrorCode.KV_PEER_GONE
            finally:
                proc.kill()
                proc.communicate()  # reaps it and closes its pipes
            landed = engine.kv_pool[dst].clone()
            await asyncio.sleep(0.3)
            assert torch.equal(engine.kv_pool[dst], landed)  # nothing after the fence
            assert await worker.drained(10)
            for _ in range(200):
                if engine.last_stats.free_blocks == engine.last_stats.total_blocks:
                    break
                await asyncio.sleep(0.05)
            assert engine.last_stats.free_blocks == engine.last_stats.total_blocks
            assert engine.last_stats.running == 0
            assert not rx._transfers
            for _ in range(100):
                if rx._rings is not None and rx._rings.count == 0:
                    break
                await asyncio.sleep(0.05)
            assert rx._rings is not None and rx._rings.count == 0
    assert staging_files() == before


async def _drain(worker: Any, request_id: str, transfer_id: str) -> None:
    async for _ in worker.generate_remote(request_id, transfer_id):
        pytest.fail("a token came from KV whose writer died mid-transfer")


@pytest.mark.parametrize("path", ["cma", "ring", "ucx"])
async def test_a_signed_transfer_in_parts_lands_on_every_path(path: str) -> None:
    """Issue 19 item 1 on each same-host path and UCX, signed (the cluster's default): parts
    land as they come, only the last write completes the transfer, and a part from another
    signed writer is refused without ending it."""
    src = pool(5)
    async with KVReceiver(pool(1), LAYOUT, DESC_ID, auth=KVAuth(KEY, authorize_sender=_anyone),
                          fence_grace_s=0.1, shm_slot_bytes=3 * LAYOUT.block_nbytes // 2,
                          shm_slots=2, shm_cma=path == "cma") as rx, \
            KVSender(LAYOUT, resolver(rx.address), auth=signed(), shm=path != "ucx") as tx, \
            KVSender(LAYOUT, resolver(rx.address),
                     auth=KVAuth(KEY, sender_id="prefill-other")) as other:
        src_ids, dst_ids = list(range(10)), [20 + i for i in range(10)]
        xid = uuid.uuid4().hex
        landed = rx.expect(xid, dst_ids, timeout_s=10)
        await tx.send(DESC_ID, src, src_ids[:4], dst_ids[:4], xid, 10, part=True)
        with pytest.raises(KVTransferError) as info:
            await other.send(DESC_ID, src, [0], [dst_ids[4]], xid, 10, part=True)
        assert info.value.code == ErrorCode.KV_DUPLICATE_TRANSFER
        await tx.send(DESC_ID, src, src_ids[4:8], dst_ids[4:8], xid, 10, part=True)
        assert not landed.done()
        await tx.send(DESC_ID, src, src_ids[8:], dst_ids[8:], xid, 10, notice={"k": 2})
        assert await landed == {"k": 2}
        assert torch.equal(rx._pool.tensor[dst_ids], src[src_ids])
        assert path_of(tx) == path

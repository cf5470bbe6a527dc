"""DecodeWorker.allocate_and_generate, the decode side of a remote prefill in one stream
(issue 19 item 4): the allocation first, then the tokens once the KV lands. A real engine and
KVReceiver (UCX on loopback), no gRPC: the stream's guarantees hold in the worker itself.

- a prefill engine's KV sent with the first token in the notice: the stream's tokens are those
  of a local prefill on the same worker;
- the consumer leaving after the allocation (before the KV wait), or during the KV wait, gets
  the transfer fenced and the blocks freed at once, not when the lease ends;
- no writer within the lease: ``kv_timeout``, blocks freed; refusals (``kv_pending_limit``)
  come before any allocation.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import AsyncIterator
from typing import Any

import pytest

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

from decode_svc.worker import DecodeWorker
from kvxfer import KVReceiver, KVSender
from pdserve.control import KVDescriptor, make_descriptor_id
from pdserve.engine.async_engine import AsyncEngine
from pdserve.errors import CapacityError, ErrorCode, KVTransferError
from pdserve.handover import FirstToken
from pdserve.kv_layout import KVDestination
from pdserve.types import GenerateRequest, SamplingParams, TokenEvent
from tests.helpers.engine_util import until as _until

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]  # real engine + UCX: seconds

DESC_ID = make_descriptor_id("decode-a", 5)


def greedy(n: int = 6) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0)


@contextlib.asynccontextmanager
async def _decode_worker(make_engine: Any, kv_cache_bytes: int, pending_fraction: float
                         ) -> AsyncIterator[DecodeWorker]:
    async with AsyncEngine(make_engine(kv_cache_bytes=kv_cache_bytes)) as engine, \
            KVReceiver(engine.kv_pool, engine.layout, DESC_ID, fence_grace_s=0.1) as rx:
        worker = DecodeWorker(engine, rx, worker_id="decode-a", max_alloc_lease_s=60.0,
                              max_pending_kv_fraction=pending_fraction)
        try:
            yield worker
        finally:
            await worker.close()


@pytest.fixture
async def decode(make_engine: Any) -> AsyncIterator[DecodeWorker]:
    async with _decode_worker(make_engine, 64 << 20, 0.25) as worker:
        yield worker


def _sample(worker: DecodeWorker, name: str) -> float | None:
    return worker.metrics.registry.get_sample_value(name)


def _all_free(worker: DecodeWorker) -> bool:
    s = worker.engine.last_stats
    return (not worker._pending and worker.num_requests == 0 and worker.pending_kv_blocks == 0
            and s.free_blocks == s.total_blocks)


async def _local(worker: DecodeWorker, req: GenerateRequest) -> list[int]:
    return [ev.token_id async for ev in worker.generate(req) if ev.token_id is not None]


async def test_remote_stream_matches_local_prefill(make_engine: Any,
                                                   decode: DecodeWorker,
                                                   prompt_ids: list[list[int]]) -> None:
    prompt = tuple(prompt_ids[1])
    want = await _local(decode, GenerateRequest("local", prompt, greedy()))
    req = GenerateRequest("remote", prompt, greedy())
    rx = decode.receiver

    async def resolve(descriptor_id: str) -> KVDescriptor | None:
        return KVDescriptor(DESC_ID, "decode-a", 5, rx.address, decode.engine.layout)

    async with AsyncEngine(make_engine(kv_cache_bytes=64 << 20)) as prefill, \
            KVSender(decode.engine.layout, resolve) as tx:
        stream = decode.allocate_and_generate(req)
        slot = await anext(stream)
        assert isinstance(slot, KVDestination) and slot.transfer_id and slot.layout
        skip = slot.num_cached_tokens // decode.block_size  # what "local" left cached
        done = await prefill.prefill(req)
        try:
            assert done.first.token_id is not None
            await tx.send(DESC_ID, prefill.kv_pool, done.block_ids[skip:],
                          slot.block_ids[skip:], slot.transfer_id, 10,
                          notice=FirstToken(done.first.token_id, done.first.logprob).to_notice())
        finally:
            await prefill.release(req.request_id)
        events: list[TokenEvent] = []
        async for item in stream:
            assert isinstance(item, TokenEvent)
            events.append(item)
    assert [ev.token_id for ev in events if ev.token_id is not None] == want
    assert events[-1].finished
    await _until(lambda: _all_free(decode))


@pytest.mark.parametrize("leave", ["after_allocation", "while_waiting"])
async def test_leaving_the_stream_frees_the_blocks_at_once(decode: DecodeWorker,
                                                           prompt_ids: list[list[int]],
                                                           leave: str) -> None:
    """Closed long before the lease (60 s here) or the KV wait ends: fenced and freed now."""
    req = GenerateRequest(f"leave-{leave}", tuple(prompt_ids[0]), greedy())
    stream = decode.allocate_and_generate(req, lease_s=60.0, timeout_s=60.0)
    slot = await anext(stream)
    assert isinstance(slot, KVDestination)
    assert decode.engine.last_stats.free_blocks < decode.engine.last_stats.total_blocks or \
        decode.pending_kv_blocks > 0
    if leave == "while_waiting":
        waiting = asyncio.create_task(anext(stream))  # type: ignore[arg-type]
        await _until(lambda: decode._pending[req.request_id].claimed)
        assert decode.num_requests == 1 and decode.active_streams == 1
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
    await stream.aclose()
    await _until(lambda: _all_free(decode), timeout_s=20.0)
    assert slot.transfer_id not in decode.receiver._transfers  # fenced: nothing may land


async def test_no_writer_within_the_lease_is_kv_timeout(decode: DecodeWorker,
                                                        prompt_ids: list[list[int]]) -> None:
    req = GenerateRequest("no-writer", tuple(prompt_ids[0]), greedy())
    stream = decode.allocate_and_generate(req, lease_s=0.3, timeout_s=30.0)
    assert isinstance(await anext(stream), KVDestination)
    with pytest.raises(KVTransferError) as failed:
        async with asyncio.timeout(5):
            async for _ in stream:
                pytest.fail("a token without KV")
    assert failed.value.code == ErrorCode.KV_TIMEOUT
    await _until(lambda: _all_free(decode))


class _SlowPartsSender(KVSender):
    """A KVSender whose writes start at least `gap_s` after the one before landed (a
    prefill worker slower than its lease, making progress)."""

    gap_s = 0.0
    sends = 0
    _landed = 0.0

    async def send(self, *args: Any, **kw: Any) -> Any:  # type: ignore[override]
        loop = asyncio.get_running_loop()
        if self.sends:
            await asyncio.sleep(self._landed + self.gap_s - loop.time())
        self.sends += 1
        try:
            return await super().send(*args, **kw)
        finally:
            self._landed = loop.time()


async def test_each_part_that_lands_renews_the_lease(make_engine: Any,
                                                     prompt_ids: list[list[int]]) -> None:
    """A prefill worker whose KV keeps landing part by part is not cut off at the lease,
    though it takes longer in all: each part renews it (within the stream's KV wait), and
    the stream decodes what a local prefill would."""
    from prefill_svc.worker import PrefillWorker

    prompt = tuple(max(prompt_ids, key=len))
    req = GenerateRequest("renewed", prompt, greedy())
    async with AsyncEngine(make_engine(kv_cache_bytes=64 << 20)) as ref:
        want = [ev.token_id async for ev in ref.generate(GenerateRequest("ref", prompt, greedy()))
                if ev.token_id is not None]
    async with _decode_worker(make_engine, 128 << 20, 1.0) as decode:
        rx = decode.receiver

        async def resolve(descriptor_id: str) -> KVDescriptor | None:
            return KVDescriptor(DESC_ID, "decode-a", 5, rx.address, decode.engine.layout)

        engine = AsyncEngine(make_engine(kv_cache_bytes=64 << 20))
        async with engine, _SlowPartsSender(engine.layout, resolve) as tx:
            tx.gap_s = 3.5
            worker = PrefillWorker(engine, tx, worker_id="prefill-a")
            loop = asyncio.get_running_loop()
            stream = decode.allocate_and_generate(req, lease_s=6.0, timeout_s=60.0)
            slot = await anext(stream)
            assert isinstance(slot, KVDestination)
            t0 = loop.time()

            async def consume() -> list[Any]:  # claims the allocation now, as a router does
                return [item async for item in stream]

            consumer = asyncio.create_task(consume())
            await worker.prefill(req, slot)
            events = await consumer
        assert tx.sends >= 3 and loop.time() - t0 > 6.0  # two gaps: past the first lease
        # Counted, so an operator sees how often a lease was outlived (and kept).
        assert _sample(decode, "pdserve_decode_kv_landed_past_lease_total") == 1.0
        assert [ev.token_id for ev in events if isinstance(ev, TokenEvent)
                and ev.token_id is not None] == want
        await _until(lambda: _all_free(decode))


async def test_refused_before_any_allocation(decode: DecodeWorker) -> None:
    """Past the worker's bound on blocks waiting for KV, the stream fails before its first
    item (the router then prefills locally), and what the others hold is untouched."""
    held: list[Any] = []
    with pytest.raises(CapacityError) as refused:
        for i in range(decode.engine.layout.num_blocks + 1):  # one block each
            prompt = tuple(range(1000 + 8 * i, 1008 + 8 * i))
            stream = decode.allocate_and_generate(GenerateRequest(f"pin-{i}", prompt, greedy()),
                                                  lease_s=60.0)
            held.append(stream)
            await anext(stream)
    assert refused.value.code == "kv_pending_limit"
    assert decode.pending_kv_blocks == decode.max_pending_kv_blocks == len(held) - 1
    for stream in held:
        await stream.aclose()
    await _until(lambda: _all_free(decode))


class _CountingSender(KVSender):
    """A KVSender that records each send's block count and whether it was a part."""

    sends: list[tuple[int, bool]]

    async def send(self, *args: Any, **kw: Any) -> Any:  # type: ignore[override]
        self.sends.append((len(args[2]), bool(kw.get("part"))))
        return await super().send(*args, **kw)


@pytest.mark.parametrize("shm", [True, False], ids=["same-host", "ucx"])
async def test_prefill_worker_sends_its_kv_while_the_prompt_computes(
        make_engine: Any, prompt_ids: list[list[int]], shm: bool) -> None:
    """Issue 19 item 1: a PrefillWorker prefilling a >1,000-token prompt in 512-token chunks
    sends the first chunks' blocks as parts of the transfer while later chunks compute; the
    decode stream equals a local prefill on an engine of the same configuration."""
    prompt = tuple(max(prompt_ids, key=len))
    async with AsyncEngine(make_engine(kv_cache_bytes=64 << 20)) as ref:
        want = [ev.token_id async for ev in ref.generate(GenerateRequest("ref", prompt, greedy()))
                if ev.token_id is not None]
    req = GenerateRequest("overlap", prompt, greedy())
    async with _decode_worker(make_engine, 128 << 20, 1.0) as decode:
        await _prefill_remotely(make_engine, decode, req, shm, want)


async def _prefill_remotely(make_engine: Any, decode: DecodeWorker, req: GenerateRequest,
                            shm: bool, want: list[int]) -> None:
    from prefill_svc.worker import PrefillWorker

    rx = decode.receiver

    async def resolve(descriptor_id: str) -> KVDescriptor | None:
        return KVDescriptor(DESC_ID, "decode-a", 5, rx.address, decode.engine.layout)

    engine = AsyncEngine(make_engine(kv_cache_bytes=64 << 20))
    async with engine, _CountingSender(engine.layout, resolve, shm=shm) as tx:
        tx.sends = []
        worker = PrefillWorker(engine, tx, worker_id="prefill-a")
        stream = decode.allocate_and_generate(req)
        slot = await anext(stream)
        assert isinstance(slot, KVDestination) and slot.num_cached_tokens == 0
        report = await worker.prefill(req, slot)
        events = [item async for item in stream]
    assert [ev.token_id for ev in events if isinstance(ev, TokenEvent)
            and ev.token_id is not None] == want
    parts = [n for n, part in tx.sends if part]
    assert parts and not tx.sends[-1][1]  # parts, then the last write with the first token
    assert sum(n for n, _ in tx.sends) == len(slot.block_ids)  # each block sent once
    assert report.bytes_transferred == len(slot.block_ids) * decode.engine.layout.block_nbytes
    assert _sample(decode, "pdserve_decode_kv_landed_past_lease_total") == 0.0  # within it
    await _until(lambda: _all_free(decode))
    assert await worker.drained(30)  # the reply does not wait for the free (below)
    assert engine.last_stats.free_blocks == engine.last_stats.total_blocks


async def test_a_prefill_replies_before_its_blocks_are_freed(
        make_engine: Any, prompt_ids: list[list[int]]) -> None:
    """The engine thread frees a prefill's blocks between its steps, maybe behind another
    prompt's step of hundreds of ms. The prefill's reply does not wait for that (the router
    holds a remote stream's last token for it); the free is queued at once, and the worker
    is drained only once it is done."""
    from prefill_svc.worker import PrefillWorker

    held = threading.Event()

    class BusyAtTheFree(AsyncEngine):
        """The engine thread busy when the blocks are to be freed (as behind a long step)."""

        def release_soon(self, request_id: str) -> asyncio.Future[None]:
            self._submit(lambda: held.wait(60))
            return super().release_soon(request_id)

    async def resolve(descriptor_id: str) -> KVDescriptor | None:
        return None

    engine = BusyAtTheFree(make_engine(kv_cache_bytes=64 << 20))
    async with engine, KVSender(engine.layout, resolve) as tx:
        try:
            worker = PrefillWorker(engine, tx, worker_id="prefill-a")
            req = GenerateRequest("held", tuple(prompt_ids[0]), greedy(1))
            report = await asyncio.wait_for(worker.prefill(req, None), 60)
            assert report.num_computed_tokens == len(req.token_ids)
            assert not await worker.drained(0.2)  # its free waits on the engine thread
        finally:
            held.set()
        assert await worker.drained(30)
        stats = await engine.stats()
        assert stats.free_blocks == stats.total_blocks

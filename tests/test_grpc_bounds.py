"""A worker's gRPC server is bounded before authentication (issue 21, item 4): a real decode
worker process (model, Redis registration, cluster secret) flooded by callers without the
cluster credential.

- 1,000 unauthenticated calls, 16 MiB messages without a credential and health probes that
  never send their request: an authenticated call keeps working throughout, the worker's
  memory grows by less than 8 MiB (its 64 KiB HTTP/2 receive windows, no BDP probe), and its
  log gets one line per refusal reason.
- A message over the worker's limit (computed from the model's context length) is refused
  with RESOURCE_EXHAUSTED before any handler sees it; the largest legitimate request fits.
- Calls beyond --max-concurrent-rpcs are refused with RESOURCE_EXHAUSTED.
- A channel that pings too often is cut off (GOAWAY too_many_pings) while the project's own
  channels, pinging as `transport.channel_options` says, keep working.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.cluster import LocalCluster
from pdserve.engine.config import ModelConfig
from pdserve.ratelog import RateLimitedLog
from pdserve.rpc import transport as gu
from pdserve.rpc.auth import CLUSTER_TOKEN_KEY, MAX_OPEN_CALLS, ClusterSecret
from pdserve.runtime import start_server
from pdserve.types import MAX_JSON_SCHEMA_CHARS, MAX_LOGIT_BIAS, MAX_STOP_STRINGS
from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from pdserve.worker_config import default_max_message_bytes

pytestmark = pytest.mark.timeout(600)

SECRET = f"bounds-secret-{uuid.uuid4().hex}"
CREDENTIAL = ClusterSecret(SECRET.encode()).grpc_metadata()
WRONG = ((CLUSTER_TOKEN_KEY, "0" * 64),)
MAX_RPCS = 96  # the worker's --max-concurrent-rpcs here
STATS = "/pdserve.v1.DecodeWorker/Stats"
CHECK = "/grpc.health.v1.Health/Check"
Code = grpc.StatusCode


@pytest.fixture(scope="module")
def worker(model_dir: Path) -> Iterator[tuple[LocalCluster, str]]:
    """Redis and one decode worker process (no router: nobody else calls the worker)."""
    cluster = LocalCluster(prefill=0, decode=1, model=str(model_dir), cluster_secret=SECRET,
                           env={"PDSERVE_LOG_LEVEL": "INFO"},
                           extra_worker_args=("--threads", "1", "--kv-cache-mb", "64",
                                              "--max-concurrent-rpcs", str(MAX_RPCS)))
    try:
        cluster.start_redis()
        cluster.add_worker("decode", 0, timeout_s=300)
        yield cluster, f"127.0.0.1:{cluster.ports['decode-0']}"
    finally:
        cluster.close()


def _log(cluster: LocalCluster) -> str:
    return (cluster.log_dir / "decode-0.log").read_text(errors="replace")


def _rss_bytes(cluster: LocalCluster) -> int:
    status = Path(f"/proc/{cluster.procs['decode-0'].pid}/status").read_text()
    line = next(x for x in status.splitlines() if x.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def _raw(channel: grpc.aio.Channel, method: str) -> Any:
    """A unary callable sending bytes as they are (no serializer)."""
    return channel.unary_unary(method)


async def _code(call: Any) -> Code:
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return Code.OK


async def _stats(channel: grpc.aio.Channel) -> decode_pb2.DecodeStats:
    return await decode_pb2_grpc.DecodeWorkerStub(channel).Stats(
        common_pb2.StatsRequest(), timeout=10, metadata=CREDENTIAL)


async def _never_sends() -> AsyncIterator[bytes]:
    """A request stream that never yields: the call's headers go out, no message ever."""
    await asyncio.Event().wait()
    yield b""  # pragma: no cover


async def test_unauthenticated_flood_locks_nobody_out(
        worker: tuple[LocalCluster, str]) -> None:
    cluster, address = worker
    async with gu.insecure_channel(address) as ch:
        await _stats(ch)  # ready, and the baseline below is taken after start-up
    log_before = _log(cluster)
    rss_before = _rss_bytes(cluster)
    channels = [gu.insecure_channel(address) for _ in range(4)]
    try:
        # Health probes that never send their request: at most MAX_OPEN_CALLS are held (each
        # until the read timeout), the others are refused at once.
        probes = [asyncio.ensure_future(_code(channels[i % 4].stream_unary(CHECK)(
            _never_sends(), timeout=30))) for i in range(MAX_OPEN_CALLS + 24)]
        big = b"\x00" * (16 << 20)  # 16 MiB, 16x the worker's limit
        oversized = [asyncio.ensure_future(_code(_raw(channels[i % 4], STATS)(
            big, timeout=30))) for i in range(8)]
        gate = asyncio.Semaphore(24)

        async def unauthenticated(i: int) -> Code:
            metadata = () if i % 3 else WRONG  # missing or wrong credential
            request = (decode_pb2.CachedPrefixRequest(token_ids=[1, 2, 3]) if i % 10 == 0
                       else common_pb2.StatsRequest())
            stub = decode_pb2_grpc.DecodeWorkerStub(channels[i % 4])
            method = stub.CachedPrefix if i % 10 == 0 else stub.Stats
            async with gate:
                return await _code(method(request, timeout=30, metadata=metadata))

        flood = asyncio.ensure_future(asyncio.gather(*map(unauthenticated, range(1000))))
        # An authenticated caller on its own channel, all the while.
        latencies = []
        async with gu.insecure_channel(address) as mine:
            while not (flood.done() and all(p.done() for p in probes)):
                started = time.monotonic()
                stats = await _stats(mine)
                latencies.append(time.monotonic() - started)
                assert stats.num_total_blocks > 0
                await asyncio.sleep(0.05)
        codes = await flood
        probe_codes = await asyncio.gather(*probes)
        oversized_codes = await asyncio.gather(*oversized)
    finally:
        for c in channels:
            await c.close()

    assert set(codes) == {Code.UNAUTHENTICATED}, set(codes)
    assert set(oversized_codes) == {Code.UNAUTHENTICATED}, oversized_codes
    held = probe_codes.count(Code.DEADLINE_EXCEEDED)  # read timeout: sent no request
    assert held <= MAX_OPEN_CALLS and probe_codes.count(Code.RESOURCE_EXHAUSTED) >= 24, \
        probe_codes
    assert len(latencies) >= 5 and max(latencies) < 5.0, latencies
    # 128 MiB of unauthenticated messages were never buffered: at most a 64 KiB receive
    # window of each before its call was refused (with grpc's BDP probe growing the window the
    # worker kept 13-29 MB of them, and up to 79 MB with ucxx's CUDA-context import beside it).
    assert _rss_bytes(cluster) - rss_before < 8 << 20
    # One line per refusal reason (missing, wrong credential), nothing else per call.
    new_lines = _log(cluster)[len(log_before):].splitlines()
    refusals = [x for x in new_lines if "grpc_call_unauthenticated" in x]
    assert 1 <= len(refusals) <= 2, refusals
    assert len(new_lines) <= 6, new_lines
    assert SECRET not in _log(cluster)
    async with gu.insecure_channel(address) as ch:  # and afterwards, of course
        await _stats(ch)


async def test_message_over_the_limit_is_refused_before_any_handler(
        worker: tuple[LocalCluster, str], model_dir: Path) -> None:
    _, address = worker
    max_model_len = ModelConfig.from_dir(model_dir).max_position_embeddings
    limit = default_max_message_bytes(max_model_len)
    # The largest request the worker can legitimately get: a whole context of 5-byte token
    # ids, and sampling parameters at the validation limits with the rest of a 1 MiB client
    # request in stop strings.
    sampling = common_pb2.SamplingParams(
        json_schema="x" * MAX_JSON_SCHEMA_CHARS,
        logit_bias={2**31 - 1 - i: -100.0 for i in range(MAX_LOGIT_BIAS)})
    room = (1 << 20) - sampling.ByteSize()
    sampling.stop.extend(["s" * (room // MAX_STOP_STRINGS - 8)] * MAX_STOP_STRINGS)
    largest = decode_pb2.AllocateAndGenerateRequest(input=common_pb2.GenerateInput(
        request_id="r" * 256, prompt_token_ids=[2**31 - 1] * max_model_len, sampling=sampling,
        latency_class=common_pb2.LATENCY_CLASS_BATCH), lease_ms=2**32 - 1,
        transfer_timeout_ms=2**32 - 1)
    assert largest.ByteSize() <= limit, (largest.ByteSize(), limit)

    async with gu.insecure_channel(address) as ch:
        stub = decode_pb2_grpc.DecodeWorkerStub(ch)
        # It passes the size check (and is then refused for its out-of-vocabulary ids).
        assert await _code(stub.AllocateAndGenerate(largest, timeout=60, metadata=CREDENTIAL)
                           .read()) == Code.INVALID_ARGUMENT
        # 5-byte varints: a CachedPrefix message of exactly `limit` bytes, and one over.
        fits = decode_pb2.CachedPrefixRequest(token_ids=[2**31 - 1] * ((limit - 8) // 5))
        assert await _code(stub.CachedPrefix(fits, timeout=60, metadata=CREDENTIAL)) == Code.OK
        over = decode_pb2.CachedPrefixRequest(token_ids=[2**31 - 1] * (limit // 5 + 1))
        assert over.ByteSize() > limit
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.CachedPrefix(over, timeout=60, metadata=CREDENTIAL)
        assert refused.value.code() == Code.RESOURCE_EXHAUSTED
        assert "larger than max" in (refused.value.details() or "")
        await _stats(ch)


async def test_calls_beyond_the_cap_are_refused(worker: tuple[LocalCluster, str]) -> None:
    """MAX_RPCS authenticated health watches (streams that stay open) take every slot; one
    more call of any kind is RESOURCE_EXHAUSTED until a slot is free again."""
    _, address = worker
    channels = [gu.insecure_channel(address) for _ in range(4)]
    watches: list[Any] = []
    try:
        for i in range(MAX_RPCS):
            watch = health_pb2_grpc.HealthStub(channels[i % 4]).Watch(
                health_pb2.HealthCheckRequest(), timeout=120, metadata=CREDENTIAL)
            await asyncio.wait_for(watch.read(), 30)  # its first status: the call is live
            watches.append(watch)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _stats(channels[0])
        assert refused.value.code() == Code.RESOURCE_EXHAUSTED
        watches.pop().cancel()
        deadline = time.monotonic() + 10
        while True:  # the freed slot is counted once the server has seen the cancel
            try:
                await _stats(channels[0])
                break
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == Code.RESOURCE_EXHAUSTED and time.monotonic() < deadline
                await asyncio.sleep(0.1)
    finally:
        for watch in watches:
            watch.cancel()
        for c in channels:
            await c.close()


async def _watch_until(channel: grpc.aio.Channel, seconds: float) -> Code:
    """Hold an authenticated health watch for `seconds`; how it ended (CANCELLED: it lasted)."""
    watch = health_pb2_grpc.HealthStub(channel).Watch(
        health_pb2.HealthCheckRequest(), timeout=seconds + 30, metadata=CREDENTIAL)
    try:
        await asyncio.wait_for(watch.read(), 30)
        await asyncio.wait_for(watch.read(), seconds)  # no second status comes
    except TimeoutError:
        watch.cancel()
        return Code.CANCELLED
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return Code.OK


async def test_ping_flood_cuts_off_only_the_abuser(worker: tuple[LocalCluster, str]) -> None:
    _, address = worker
    abusive = [("grpc.keepalive_time_ms", 100), ("grpc.keepalive_permit_without_calls", 1),
               ("grpc.http2.max_pings_without_data", 0),
               ("grpc.http2.min_time_between_pings_ms", 10)]
    async with (grpc.aio.insecure_channel(address, options=abusive) as bad,
                gu.insecure_channel(address) as good):
        bad_end, good_end = await asyncio.gather(_watch_until(bad, 12), _watch_until(good, 12))
        assert bad_end == Code.UNAVAILABLE  # GOAWAY ENHANCE_YOUR_CALM too_many_pings
        assert good_end == Code.CANCELLED  # still open when we ended it
        await _stats(good)


async def test_our_keepalive_is_never_taken_for_abuse() -> None:
    """`channel_options` and `server_options` with one keepalive (shortened here to see many
    pings) agree: an idle call with a ping every 0.5 s outlives 5 s."""
    server = gu.new_server(keepalive_ms=500)
    health = await gu.add_health(server)
    address = await start_server(server, "127.0.0.1", 0)
    try:
        async with gu.insecure_channel(address, keepalive_ms=500) as ch:
            watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(),
                                                         timeout=30)
            await asyncio.wait_for(watch.read(), 10)
            with pytest.raises(TimeoutError):  # nothing ends it: neither a status nor GOAWAY
                await asyncio.wait_for(watch.read(), 5)
            watch.cancel()
    finally:
        await server.stop(None)
    del health


def test_rate_limited_log_counts_what_it_suppresses() -> None:
    lines: list[dict[str, Any]] = []

    class Sink:
        def warning(self, event: str, **fields: Any) -> None:
            lines.append({"event": event, **fields})

    now = [0.0]
    ratelog = RateLimitedLog(Sink(), "refused", interval_s=30, max_keys=2,
                             clock=lambda: now[0])
    for _ in range(100):
        ratelog("missing", reason="missing")
    ratelog("wrong", reason="wrong")
    assert [x["suppressed"] for x in lines] == [0, 0] and ratelog.total == 101
    now[0] = 31.0
    assert ratelog("missing", reason="missing")
    assert lines[-1] == {"event": "refused", "reason": "missing", "suppressed": 99}
    for key in range(10):  # keys past max_keys share one line
        ratelog(f"k{key}")
    assert len(lines) == 4

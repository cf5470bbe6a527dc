"""Hostile input against the gRPC APIs (issue 13, items 3 and 4, and the gRPC half of 6):
the Router validates as the REST gateway does, callers cannot pin a decode worker's KV
blocks, tokenizing stays off the event loop, and hypothesis-generated messages (and bytes
that are no message) get INVALID_ARGUMENT, OK or a documented status, never INTERNAL or UNKNOWN.

A real decode and prefill worker (`run_decode`, `run_prefill`: model, UCX, Redis
registration) and a real Router with its servicer on a gRPC server, all in this process on a
private event loop; the clients are plain synchronous gRPC stubs.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import structlog
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.rpc import transport as gu
from pdserve.rpc.errors import ERROR_CODE_KEY
from pdserve.rpc.metadata import REQUEST_ID_KEY
from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, router_pb2
from tests.helpers.gated_tokenizer import GatedTokenizer
from tests.helpers.loop_thread import serve_in_thread
from tests.helpers.protobuf_strategies import messages, raw_messages

LEASE_CAP_S = 2.0  # the decode worker's max_alloc_lease_s here
KV_WAIT_CAP_S = 3.0  # its max_kv_wait_s
HUGE_MS = 2**32 - 1  # ~49 days, the largest lease or wait a caller can ask for
ROUTER_SERVICE = "pdserve.v1.Router"
Code = grpc.StatusCode


class RpcCounter:
    """Client interceptors counting the router's calls to workers, and how many of them carry
    the prompt (a CachedPrefix query, or a GenerateInput with the prompt's token ids)."""

    def __init__(self) -> None:
        self.calls: collections.Counter[str] = collections.Counter()
        self.prompt_copies = 0
        counter = self

        class Unary(grpc.aio.UnaryUnaryClientInterceptor):
            async def intercept_unary_unary(self, continuation, details, request):  # type: ignore[no-untyped-def]
                counter._count(details, request)
                return await continuation(details, request)

        class Stream(grpc.aio.UnaryStreamClientInterceptor):
            async def intercept_unary_stream(self, continuation, details, request):  # type: ignore[no-untyped-def]
                counter._count(details, request)
                return await continuation(details, request)

        self.interceptors = (Unary(), Stream())

    def _count(self, details: Any, request: Any) -> None:
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        self.calls[method.rsplit("/", 1)[-1]] += 1
        carries = (getattr(request, "token_ids", None) if hasattr(request, "token_ids")
                   else request.input.prompt_token_ids if hasattr(request, "input") else None)
        self.prompt_copies += bool(carries)

    def reset(self) -> None:
        self.calls.clear()
        self.prompt_copies = 0


@dataclass(frozen=True)
class Cluster:
    router: str
    decode: str
    prefill: str
    descriptor_id: str  # the decode worker's KV pool
    gate: GatedTokenizer
    rpcs: RpcCounter  # the router's calls to the workers


@contextlib.asynccontextmanager
async def serve_cluster(redis_url: str, model_dir: Path, gate: GatedTokenizer, rpcs: RpcCounter,
                        n_decode: int = 1) -> AsyncIterator[Cluster]:
    """`n_decode` decode workers and one prefill worker (`run_decode`, `run_prefill`) and a
    Router with its servicer on a gRPC server, on the running loop. The Cluster names the
    first decode worker."""
    from decode_svc.main import DecodeConfig, run_decode
    from pdserve.control.registry import WorkerRegistry
    from pdserve.engine.config import EngineConfig, ModelConfig
    from pdserve.runtime import start_server
    from pdserve.v1 import router_pb2_grpc
    from prefill_svc.main import PrefillConfig, run_prefill
    from router.clients import WorkerChannels
    from router.config import RouterConfig
    from router.main import RouterProcessConfig
    from router.policy import RouterPolicy
    from router.router import Router
    from router.servicer import RouterServicer

    namespace = f"hostile{uuid.uuid4().hex[:8]}"
    common: dict[str, Any] = dict(redis_url=redis_url, model=str(model_dir),
                                  engine=EngineConfig(kv_cache_bytes=32 << 20), metrics_port=-1,
                                  namespace=namespace, drain_timeout_s=5.0)
    configs: list[Any] = [
        DecodeConfig(worker_id=f"decode-{i}", alloc_lease_s=1.0, max_alloc_lease_s=LEASE_CAP_S,
                     max_kv_wait_s=KV_WAIT_CAP_S, **common) for i in range(n_decode)]
    configs.append(PrefillConfig(worker_id="prefill-0", transfer_timeout_s=5.0, **common))
    stop = asyncio.Event()
    ready = [asyncio.Event() for _ in configs]
    workers = [asyncio.create_task((run_decode if isinstance(c, DecodeConfig) else run_prefill)(
        c, stop, r)) for c, r in zip(configs, ready, strict=True)]
    try:
        for event in ready:  # fail fast if a worker dies while starting
            waiter = asyncio.create_task(event.wait())
            await asyncio.wait([waiter, *workers], return_when=asyncio.FIRST_COMPLETED)
            if not waiter.done():
                waiter.cancel()
                for w in workers:
                    if w.done():
                        w.result()  # raises what stopped it
                raise RuntimeError("a worker exited while starting")
        max_model_len = ModelConfig.from_dir(model_dir).max_position_embeddings
        async with (WorkerRegistry.from_url(redis_url, namespace=namespace) as registry,
                    Router(registry, gate, model_name=model_dir.name,
                           max_model_len=max_model_len, poll_s=0.1,
                           # the remote-path tests need a known route: 256 tokens, remote
                           config=RouterConfig(policy=RouterPolicy(placement="threshold")),
                           channels=WorkerChannels(interceptors=rpcs.interceptors)) as router):
            # As run_router builds it (there with the tokenizer it loads itself).
            server = gu.new_server(max_message_bytes=RouterProcessConfig.max_request_bytes)
            router_pb2_grpc.add_RouterServicer_to_server(RouterServicer(router), server)
            health = await gu.add_health(server, ROUTER_SERVICE)
            address = await start_server(server, "127.0.0.1", 0)
            await gu.set_serving(health, ROUTER_SERVICE)
            async with asyncio.timeout(30):
                while True:  # the router has seen every worker
                    if len(router.workers("decode")) == n_decode and router.workers("prefill"):
                        break
                    await asyncio.sleep(0.05)
            decode = min(router.workers("decode"), key=lambda w: w.worker_id)
            [prefill] = router.workers("prefill")
            yield Cluster(address, decode.grpc_address, prefill.grpc_address,
                          decode.descriptor_id, gate, rpcs)
            await server.stop(grace=1.0)
    finally:
        stop.set()
        await asyncio.gather(*workers, return_exceptions=True)


@pytest.fixture(scope="module")
def gate(model_dir: Path) -> GatedTokenizer:
    # Loaded before any worker: it imports transformers, which two threads must not do at once.
    return GatedTokenizer(model_dir)


@pytest.fixture(scope="module")
def cluster(redis_server: str, model_dir: Path, gate: GatedTokenizer) -> Iterator[Cluster]:
    with serve_in_thread(lambda: serve_cluster(redis_server, model_dir, gate,
                                               RpcCounter())) as c:
        yield c


@dataclass(frozen=True)
class Outcome:
    code: grpc.StatusCode
    details: str = ""
    error_code: str | None = None  # the pdserve-error-code trailer


def call(channel: grpc.Channel, method: str, request: Message | bytes, *, stream: bool,
         metadata: tuple[tuple[str, str], ...] = (), timeout: float = 60) -> Outcome:
    """One RPC with a message or raw bytes; a stream counts as taken (OK) at its first
    response, and is then cancelled (which aborts the request on the server)."""
    serialize = None if isinstance(request, bytes) else type(request).SerializeToString
    kind = channel.unary_stream if stream else channel.unary_unary
    try:
        rpc = kind(method, request_serializer=serialize, response_deserializer=None)
        if stream:
            responses = rpc(request, timeout=timeout, metadata=metadata)
            next(responses, None)
            responses.cancel()
        else:
            rpc(request, timeout=timeout, metadata=metadata)
    except grpc.RpcError as exc:
        trailers = dict(exc.trailing_metadata() or ())  # type: ignore[attr-defined]
        return Outcome(exc.code(), exc.details(),  # type: ignore[attr-defined]
                       trailers.get(ERROR_CODE_KEY))
    return Outcome(Code.OK)


def refused(outcome: Outcome, error_code: str) -> None:
    assert (outcome.code, outcome.error_code) == (Code.INVALID_ARGUMENT, error_code), outcome


# ---------------------------------------------------------------------- 3: one validation path


GENERATE = "/pdserve.v1.Router/Generate"
DECODE_GENERATE = "/pdserve.v1.DecodeWorker/Generate"


def test_router_refuses_what_rest_refuses(cluster: Cluster, tokenizer: Any) -> None:
    ids = router_pb2.TokenIds(ids=tokenizer.encode("The capital of France is"))

    def generate(**fields: Any) -> router_pb2.GenerateRequest:
        return router_pb2.GenerateRequest(token_ids=ids, **fields)

    with grpc.insecure_channel(cluster.router) as ch:
        # The cases: ran until the caller's deadline; UNAVAILABLE; INTERNAL; UNKNOWN.
        r = call(ch, GENERATE, generate(sampling=common_pb2.SamplingParams(max_tokens=HUGE_MS)),
                 stream=True)
        refused(r, "context_length_exceeded")
        for rid in ("r" * 100_000, "a\x00b", "a\nb", "é"):
            refused(call(ch, GENERATE, generate(request_id=rid), stream=True),
                    "invalid_request_id")
        undecodable = b"\x0a\x02\xff\xfe" + generate().SerializeToString()
        refused(call(ch, GENERATE, undecodable, stream=True), "invalid_message")
        refused(call(ch, GENERATE, generate(), stream=True,
                     metadata=((REQUEST_ID_KEY, "x" * 1000),)), "invalid_request_id")
        # The same limits as REST: 256 characters is a valid id, 257 is not.
        refused(call(ch, GENERATE, generate(request_id="r" * 257), stream=True),
                "invalid_request_id")
        assert call(ch, GENERATE, generate(request_id="r" * 256), stream=True).code == Code.OK
        refused(call(ch, "/pdserve.v1.Router/Abort", common_pb2.AbortRequest(request_id="a\nb"),
                     stream=False), "invalid_request_id")
        # As big as REST takes and no bigger (1 MiB): a 2 MB prompt is never tokenized.
        big = router_pb2.GenerateRequest(text="x" * (2 << 20))
        assert call(ch, GENERATE, big, stream=True).code == Code.RESOURCE_EXHAUSTED


def test_workers_refuse_it_too_and_never_log_it(cluster: Cluster,
                                                caplog: pytest.LogCaptureFixture) -> None:
    long_id = "r" * 100_000
    caplog.set_level(logging.DEBUG)
    with structlog.testing.capture_logs(
            processors=[structlog.contextvars.merge_contextvars]) as logs, \
            grpc.insecure_channel(cluster.decode) as ch:
        request = decode_pb2.DecodeGenerateRequest(input=common_pb2.GenerateInput(
            request_id=long_id, prompt_token_ids=[1, 2, 3],
            sampling=common_pb2.SamplingParams(max_tokens=1)))
        refused(call(ch, DECODE_GENERATE, request, stream=True), "invalid_request_id")
        request.input.request_id = "ok-id"
        request.input.sampling.max_tokens = HUGE_MS
        refused(call(ch, DECODE_GENERATE, request, stream=True), "context_length_exceeded")
        refused(call(ch, "/pdserve.v1.DecodeWorker/Abort",
                     common_pb2.AbortRequest(request_id=long_id), stream=False),
                "invalid_request_id")
    logged = [str(e) for e in logs] + [r.getMessage() for r in caplog.records]
    assert logged and not [line for line in logged if "r" * 1000 in line]


# ---------------------------------------------------------------------- 4: pinned KV blocks


ALLOCATE_AND_GENERATE = "/pdserve.v1.DecodeWorker/AllocateAndGenerate"


def _status(exc: grpc.RpcError) -> tuple[grpc.StatusCode, str | None]:
    trailers = dict(exc.trailing_metadata() or ())  # type: ignore[attr-defined]
    return exc.code(), trailers.get(ERROR_CODE_KEY)  # type: ignore[attr-defined]


def _free_blocks(decode: Any) -> int:
    return int(decode.Stats(common_pb2.StatsRequest(), timeout=10).num_free_blocks)


def _chat_runs(rch: grpc.Channel) -> None:
    chat = router_pb2.GenerateRequest(
        chat=router_pb2.ChatMessages(messages=[router_pb2.ChatMessage(
            role="user", content="Name three colors.")]),
        sampling=common_pb2.SamplingParams(max_tokens=8))
    last = list(router_stub(rch).Generate(chat, timeout=120))[-1]
    assert last.finish_reason in (common_pb2.FINISH_REASON_STOP,
                                  common_pb2.FINISH_REASON_LENGTH)


def test_callers_cannot_pin_kv_blocks(cluster: Cluster, tokenizer: Any) -> None:
    """AllocateAndGenerate streams asking for a 49-day lease and KV wait: refused past half
    the pool, a chat still runs meanwhile, and the blocks come back when the worker's lease
    cap (not the caller's) ends; each such stream ends ABORTED (kv_timeout). A stream the
    caller closes after its allocation gives its blocks back."""
    with grpc.insecure_channel(cluster.decode) as ch, \
            grpc.insecure_channel(cluster.router) as rch:
        decode = decode_pb2_grpc.DecodeWorkerStub(ch)
        total = decode.Stats(common_pb2.StatsRequest(), timeout=10).num_total_blocks
        pinned: list[Any] = []
        refusal: grpc.RpcError | None = None
        try:
            for i in range(total):  # one block each: enough to pin the whole pool if allowed
                stream = decode.AllocateAndGenerate(decode_pb2.AllocateAndGenerateRequest(
                    input=common_pb2.GenerateInput(
                        request_id=f"pin-{i}", prompt_token_ids=[200 + i] * 16,
                        sampling=common_pb2.SamplingParams(max_tokens=1)),
                    lease_ms=HUGE_MS, transfer_timeout_ms=HUGE_MS), timeout=KV_WAIT_CAP_S * 20)
                try:
                    first = next(stream)
                except grpc.RpcError as exc:
                    refusal = exc
                    break
                assert first.WhichOneof("kind") == "allocation" and first.allocation.block_ids
                pinned.append(stream)
            assert refusal is not None
            assert _status(refusal) == (Code.UNAVAILABLE, "kv_pending_limit")
            stats = decode.Stats(common_pb2.StatsRequest(), timeout=10)
            assert stats.num_awaiting_transfer == len(pinned) == i and i <= total // 2
            assert stats.num_free_blocks >= total - total // 2
            _chat_runs(rch)
            for stream in pinned:  # the capped lease ran out: no writer, no blocks
                with pytest.raises(grpc.RpcError) as ended:
                    next(stream)
                assert _status(ended.value) == (Code.ABORTED, "kv_timeout"), ended.value
        finally:
            for stream in pinned:
                stream.cancel()
        wait_for(lambda: _free_blocks(decode) == total, "the capped leases never ran out")

        # Closed by the caller right after its allocation: the worker fences the transfer and
        # frees the blocks (at once: tests/test_decode_remote.py, with a long lease).
        for i in range(3):
            stream = decode.AllocateAndGenerate(decode_pb2.AllocateAndGenerateRequest(
                input=common_pb2.GenerateInput(
                    request_id=f"closed-{i}", prompt_token_ids=[300 + i] * 40,
                    sampling=common_pb2.SamplingParams(max_tokens=1)),
                lease_ms=HUGE_MS, transfer_timeout_ms=HUGE_MS), timeout=60)
            assert next(stream).WhichOneof("kind") == "allocation"
            assert _free_blocks(decode) < total
            stream.cancel()
            wait_for(lambda: _free_blocks(decode) == total, "a closed stream kept its blocks")


def test_deprecated_allocate_remote_cannot_pin_kv_blocks(cluster: Cluster) -> None:
    """The deprecated AllocateRemote/GenerateRemote pair (served one more release, no longer
    used by the router) is bounded the same way: allocations past half the pool are refused,
    unclaimed ones end with the worker's lease cap, a claimed one waits for its KV at most the
    worker's cap."""
    with grpc.insecure_channel(cluster.decode) as ch:
        decode = decode_pb2_grpc.DecodeWorkerStub(ch)
        total = decode.Stats(common_pb2.StatsRequest(), timeout=10).num_total_blocks
        refusal = None
        for i in range(total):
            request = decode_pb2.AllocateRequest(input=common_pb2.GenerateInput(
                request_id=f"old-pin-{i}", prompt_token_ids=[200 + i] * 16,
                sampling=common_pb2.SamplingParams(max_tokens=1)), lease_ms=HUGE_MS)
            refusal = call(ch, "/pdserve.v1.DecodeWorker/AllocateRemote", request,
                           stream=False, timeout=10)
            if refusal.code != Code.OK:
                break
        assert refusal is not None
        assert (refusal.code, refusal.error_code) == (Code.UNAVAILABLE, "kv_pending_limit")
        assert decode.Stats(common_pb2.StatsRequest(), timeout=10).num_awaiting_transfer == i
        assert i <= total // 2
        wait_for(lambda: _free_blocks(decode) == total, "the capped leases never ran out")

        alloc = decode.AllocateRemote(decode_pb2.AllocateRequest(input=common_pb2.GenerateInput(
            request_id="wait-0", prompt_token_ids=[7] * 20,
            sampling=common_pb2.SamplingParams(max_tokens=1))), timeout=10)
        r = call(ch, "/pdserve.v1.DecodeWorker/GenerateRemote", decode_pb2.RemoteGenerateRequest(
            request_id="wait-0", transfer_id=alloc.transfer_id, transfer_timeout_ms=HUGE_MS),
            stream=True, timeout=KV_WAIT_CAP_S * 20)
        assert (r.code, r.error_code) == (Code.ABORTED, "kv_timeout"), r
        wait_for(lambda: _free_blocks(decode) == total,
                 "an allocation that timed out kept its blocks")


def test_remote_path_rpcs_and_prompt_copies(cluster: Cluster) -> None:
    """One remote prefill costs 2 RPCs (the decode worker's AllocateAndGenerate stream,
    whose first message is the allocation, and Prefill), both carrying the prompt, whatever
    the number of decode workers: the router knows their prefix caches from their KV events
    and asks none of them (docs/ARCHITECTURE.md, "RPCs per remote request"). One decode
    worker here; 2 and 4 in the next test."""
    _assert_remote_rpcs(cluster)


@pytest.mark.parametrize("n_decode", [2, 4])
def test_remote_path_rpcs_do_not_grow_with_decode_workers(
        redis_server: str, model_dir: Path, gate: GatedTokenizer, n_decode: int) -> None:
    with serve_in_thread(lambda: serve_cluster(redis_server, model_dir, gate, RpcCounter(),
                                               n_decode=n_decode)) as c:
        for _ in range(2):  # a fresh prompt each time, on whichever decode worker
            _assert_remote_rpcs(c)


_remote_prompts = iter(range(1000, 10**9, 256))


def _assert_remote_rpcs(cluster: Cluster) -> None:
    start = next(_remote_prompts)
    ids = list(range(start, start + 256))  # 256 tokens, nothing cached: the remote threshold
    cluster.rpcs.reset()
    with grpc.insecure_channel(cluster.router) as ch:
        last = list(router_stub(ch).Generate(router_pb2.GenerateRequest(
            token_ids=router_pb2.TokenIds(ids=ids),
            sampling=common_pb2.SamplingParams(max_tokens=2)), timeout=120))[-1]
    remote = {"AllocateAndGenerate": 1, "Prefill": 1}
    if last.route == common_pb2.PREFILL_ROUTE_FALLBACK:
        # This worker waits at most KV_WAIT_CAP_S for the KV; on a busy machine the prefill
        # can take longer. The fallback adds an Abort and a local request, which travels on
        # the decode worker's Session call (a message, not a call; these interceptors see
        # unary-request calls only).
        assert dict(cluster.rpcs.calls) == {**remote, "Abort": 1}
        assert cluster.rpcs.prompt_copies == 2
    else:
        assert last.route == common_pb2.PREFILL_ROUTE_REMOTE, last
        assert dict(cluster.rpcs.calls) == remote  # the bound is <= 3
        assert cluster.rpcs.prompt_copies == 2


def router_stub(ch: grpc.Channel) -> Any:
    from pdserve.v1 import router_pb2_grpc

    return router_pb2_grpc.RouterStub(ch)


def wait_for(condition: Any, message: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(message)
        time.sleep(0.1)


# ---------------------------------------------------------------------- 6: gRPC tokenizing


def test_router_tokenizes_off_the_event_loop(cluster: Cluster) -> None:
    """While the Router tokenizes a prompt (held by the gate), its server answers health
    checks; on the event loop, the check would time out first."""
    gate = cluster.gate
    gate.arm()
    request = router_pb2.GenerateRequest(text="Hello there",
                                         sampling=common_pb2.SamplingParams(max_tokens=1))
    with grpc.insecure_channel(cluster.router) as ch, \
            concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(lambda: list(router_stub(ch).Generate(request, timeout=120)))
        try:
            assert gate.entered.wait(timeout=30), "the request never reached the tokenizer"
            health = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=ROUTER_SERVICE), timeout=20)
        finally:
            gate.release.set()
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        assert pending.result(timeout=120)[-1].finish_reason
    assert gate.released is True


# ---------------------------------------------------------------------- fuzzing


def _sampling(max_tokens: int = 4) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=max_tokens)


@dataclass(frozen=True)
class Rpc:
    server: str  # attribute of Cluster
    method: str
    request: type[Message]
    stream: bool
    allowed: frozenset[grpc.StatusCode]  # what the proto documents for client input
    examples: int
    like: Any = None  # (rid, descriptor_id, variant: bool) -> a valid request to mutate
    reaches_ok: bool = True  # some examples must get through validation


_CLIENT = frozenset({Code.OK, Code.INVALID_ARGUMENT})
RPCS = [
    Rpc("router", "Router/Generate", router_pb2.GenerateRequest, True,
        _CLIENT | {Code.UNAVAILABLE}, 30,
        lambda rid, *_: router_pb2.GenerateRequest(request_id=rid, text="Hello there",
                                                  sampling=_sampling())),
    Rpc("router", "Router/Abort", common_pb2.AbortRequest, False, _CLIENT, 10,
        lambda rid, *_: common_pb2.AbortRequest(request_id=rid)),
    Rpc("decode", "DecodeWorker/Generate", decode_pb2.DecodeGenerateRequest, True,
        _CLIENT | {Code.UNAVAILABLE}, 15,
        lambda rid, *_: decode_pb2.DecodeGenerateRequest(input=common_pb2.GenerateInput(
            request_id=rid, prompt_token_ids=[1, 2, 3, 4], sampling=_sampling()))),
    Rpc("decode", "DecodeWorker/AllocateAndGenerate", decode_pb2.AllocateAndGenerateRequest,
        True, _CLIENT | {Code.UNAVAILABLE, Code.ABORTED, Code.CANCELLED}, 15,
        # Taken at its first message (the allocation), then closed: that frees the blocks.
        lambda rid, *_: decode_pb2.AllocateAndGenerateRequest(input=common_pb2.GenerateInput(
            request_id=rid, prompt_token_ids=list(range(1, 21)), sampling=_sampling()),
            lease_ms=1000, transfer_timeout_ms=100)),
    Rpc("decode", "DecodeWorker/AllocateRemote", decode_pb2.AllocateRequest, False,
        _CLIENT | {Code.UNAVAILABLE}, 15,
        lambda rid, *_: decode_pb2.AllocateRequest(input=common_pb2.GenerateInput(
            request_id=rid, prompt_token_ids=list(range(1, 21)), sampling=_sampling()),
            lease_ms=1000)),
    Rpc("decode", "DecodeWorker/GenerateRemote", decode_pb2.RemoteGenerateRequest, True,
        _CLIENT | {Code.ABORTED, Code.CANCELLED}, 15,
        lambda rid, *_: decode_pb2.RemoteGenerateRequest(
            request_id=rid, transfer_id=f"{rid}/0", transfer_timeout_ms=100),
        reaches_ok=False),  # nothing was allocated for these
    Rpc("decode", "DecodeWorker/Abort", common_pb2.AbortRequest, False, _CLIENT, 10,
        lambda rid, *_: common_pb2.AbortRequest(request_id=rid)),
    Rpc("decode", "DecodeWorker/CachedPrefix", decode_pb2.CachedPrefixRequest, False, _CLIENT,
        10, lambda rid, *_: decode_pb2.CachedPrefixRequest(token_ids=list(range(1, 40)))),
    Rpc("decode", "DecodeWorker/Stats", common_pb2.StatsRequest, False, _CLIENT, 5),
    Rpc("prefill", "PrefillWorker/Prefill", prefill_pb2.PrefillRequest, False,
        _CLIENT | {Code.ABORTED, Code.DEADLINE_EXCEEDED}, 15,
        lambda rid, descriptor_id, to_decode: prefill_pb2.PrefillRequest(
            input=common_pb2.GenerateInput(request_id=rid, prompt_token_ids=list(range(1, 21)),
                                           sampling=_sampling(1)),
            # The real decode worker's pool, which expects no such transfer.
            destination=prefill_pb2.KVDestination(
                descriptor_id=descriptor_id, block_ids=[0, 1], transfer_id=f"{rid}/0")
            if to_decode else None)),
    Rpc("prefill", "PrefillWorker/Stats", common_pb2.StatsRequest, False, _CLIENT, 5),
]


def _session_like(rid: str) -> decode_pb2.SessionRequests:
    start = decode_pb2.DecodeGenerateRequest(input=common_pb2.GenerateInput(
        request_id=rid, prompt_token_ids=[1, 2, 3, 4], sampling=_sampling()))
    return decode_pb2.SessionRequests(requests=[
        decode_pb2.SessionRequest(stream=1, generate=start),
        decode_pb2.SessionRequest(stream=2, cancel=True)])  # a number never started


def test_fuzz_session(cluster: Cluster) -> None:
    """DecodeWorker.Session carrying one generated SessionRequests message (mostly a valid
    one with some fields made arbitrary) or bytes that are no message: the call ends OK or
    INVALID_ARGUMENT, and every request on it that fails says INVALID_ARGUMENT or UNAVAILABLE,
    as its Generate call would. Read up to the first reply, then cancelled, like the streams
    of `test_fuzz`; the worker's pool is whole again afterwards."""
    like = st.uuids().map(lambda u: _session_like(f"fuzz-{u.hex[:12]}"))
    generated = messages(decode_pb2.SessionRequests, like)
    seen: collections.Counter[str] = collections.Counter()

    @settings(max_examples=30, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(request=st.one_of(generated, generated, raw_messages(decode_pb2.SessionRequests)))
    def run(request: Message | bytes) -> None:
        serialize = None if isinstance(request, bytes) else type(request).SerializeToString
        session = ch.stream_stream("/pdserve.v1.DecodeWorker/Session",
                                   request_serializer=serialize,
                                   response_deserializer=decode_pb2.SessionResponses.FromString)
        replies = session(iter([request]), timeout=15)
        try:
            first = next(replies, None)
            replies.cancel()
        except grpc.RpcError as exc:
            seen[exc.code().name] += 1  # type: ignore[attr-defined]
            assert exc.code() in _CLIENT, exc  # type: ignore[attr-defined]
            return
        for reply in first.responses if first is not None else ():
            if reply.WhichOneof("kind") == "error":
                status = next(c for c in Code if c.value[0] == reply.error.status)
                seen[f"request {status.name}"] += 1
                assert status in {Code.INVALID_ARGUMENT, Code.UNAVAILABLE}, reply
            else:
                seen["request token"] += 1

    with grpc.insecure_channel(cluster.decode) as ch:
        total = _free_blocks(decode_pb2_grpc.DecodeWorkerStub(ch))
        run()
        wait_for(lambda: _free_blocks(decode_pb2_grpc.DecodeWorkerStub(ch)) == total,
                 "a fuzzed session kept KV blocks")
    print("DecodeWorker/Session", dict(seen))  # pytest -s: how far the examples got
    assert seen["request token"], f"no example got a request through: {dict(seen)}"
    assert seen["INVALID_ARGUMENT"], f"no example was refused as a whole: {dict(seen)}"


@pytest.mark.parametrize("rpc", RPCS, ids=[r.method for r in RPCS])
def test_fuzz(cluster: Cluster, rpc: Rpc) -> None:
    """Generated messages (mostly a valid request with some fields made arbitrary), and
    bytes that are no message: only OK, INVALID_ARGUMENT or a code the proto documents."""
    like = None if rpc.like is None else st.builds(
        rpc.like, st.uuids().map(lambda u: f"fuzz-{u.hex[:12]}"), st.just(cluster.descriptor_id),
        st.booleans())
    generated = messages(rpc.request, like)
    seen: collections.Counter[tuple[str, str | None]] = collections.Counter()

    @settings(max_examples=rpc.examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(request=st.one_of(generated, generated, raw_messages(rpc.request)))
    def run(request: Message | bytes) -> None:
        outcome = call(ch, f"/pdserve.v1.{rpc.method}", request, stream=rpc.stream)
        seen[outcome.code.name, outcome.error_code] += 1
        assert outcome.code in rpc.allowed, outcome
        if rpc.method.endswith("AllocateRemote") and outcome.code == Code.OK:
            assert isinstance(request, Message)
            call(ch, "/pdserve.v1.DecodeWorker/Abort",
                 common_pb2.AbortRequest(request_id=request.input.request_id), stream=False)

    with grpc.insecure_channel(getattr(cluster, rpc.server)) as ch:
        run()
    print(rpc.method, dict(seen))  # pytest -s: how far the examples got
    if rpc.reaches_ok:
        assert seen["OK", None], f"no example got through validation: {dict(seen)}"

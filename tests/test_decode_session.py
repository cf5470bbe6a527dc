"""DecodeWorker.Session: many local requests on one call (router.clients, decode_svc.servicer).

A real decode worker (the default model, a KV receiver) behind a real gRPC server; the
router's own `DecodeClient` on a channel whose interceptors count the calls it makes. A
request on a session streams what a Generate call streams, leaves no block behind however
it ends, fails alone (as its Generate call would, same exception and code), and a worker
without Session gets a Generate call per request.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from decode_svc import servicer as decode_servicer
from decode_svc.worker import DecodeWorker
from kvxfer import KVReceiver
from pdserve.control import make_descriptor_id
from pdserve.engine.async_engine import AsyncEngine
from pdserve.errors import CapacityError, ErrorCode, InvalidRequestError
from pdserve.rpc import transport
from pdserve.runtime import start_server
from pdserve.types import GenerateRequest, SamplingParams
from pdserve.v1 import decode_pb2_grpc
from router import clients as router_clients
from router.clients import DecodeClient
from tests.helpers.engine_util import until

TIMEOUTS = {"first_token_timeout_s": 60.0, "token_timeout_s": 60.0}


class CallCounter:
    """Client interceptors counting calls by method name, every kind of call."""

    def __init__(self) -> None:
        self.calls: collections.Counter[str] = collections.Counter()
        count = self._count

        class UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
            async def intercept_unary_stream(self, continuation, details, request):  # type: ignore[no-untyped-def]
                count(details)
                return await continuation(details, request)

        class StreamStream(grpc.aio.StreamStreamClientInterceptor):
            async def intercept_stream_stream(self, continuation, details, requests):  # type: ignore[no-untyped-def]
                count(details)
                return await continuation(details, requests)

        self.interceptors = (UnaryStream(), StreamStream())

    def _count(self, details: Any) -> None:
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        self.calls[method.rsplit("/", 1)[-1]] += 1


class NoSession(decode_servicer.DecodeServicer):
    """A worker of an older version: Session is UNIMPLEMENTED."""

    Session = decode_pb2_grpc.DecodeWorkerServicer.Session  # type: ignore[assignment]


class LostStatus(decode_servicer.DecodeServicer):
    """A worker whose Session answer reaches the client as grpc.aio reports it when the
    client's first write races the call's end (grpc/grpc#36066): INTERNAL, nothing read."""

    async def Session(self, requests: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.INTERNAL, "Internal error from Core")
        yield  # pragma: no cover (a generator, as the servicer's)


@dataclass
class Served:
    worker: DecodeWorker
    servicer: decode_servicer.DecodeServicer
    server: grpc.aio.Server
    address: str


@contextlib.asynccontextmanager
async def serve(make_engine: Any, servicer_class: type[decode_servicer.DecodeServicer]
                = decode_servicer.DecodeServicer, port: int = 0) -> AsyncIterator[Served]:
    async with AsyncEngine(make_engine(kv_cache_bytes=64 << 20)) as engine, \
            KVReceiver(engine.kv_pool, engine.layout, make_descriptor_id("decode-s", 1)) as rx:
        worker = DecodeWorker(engine, rx, worker_id="decode-s")
        server = transport.new_server()
        servicer = servicer_class(worker)
        decode_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, server)
        address = await start_server(server, "127.0.0.1", port)
        try:
            yield Served(worker, servicer, server, address)
        finally:
            await server.stop(0)
            await worker.close()


@contextlib.asynccontextmanager
async def client(address: str, *, sessions: bool = True
                 ) -> AsyncIterator[tuple[DecodeClient, CallCounter]]:
    counter = CallCounter()
    async with transport.insecure_channel(address, interceptors=counter.interceptors) as ch:
        c = DecodeClient(ch, worker_id="decode-s", sessions=sessions)
        try:
            yield c, counter
        finally:
            c.close()


def request(rid: str, prompt: list[int], max_tokens: int = 6) -> GenerateRequest:
    return GenerateRequest(request_id=rid, prompt_token_ids=tuple(prompt),
                           sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                   ignore_eos=True))


async def tokens(c: DecodeClient, req: GenerateRequest) -> list[int]:
    return [ev.token_id async for ev in c.generate(req, **TIMEOUTS) if ev.token_id is not None]


def all_free(worker: DecodeWorker) -> bool:
    s = worker.engine.last_stats
    return worker.num_requests == 0 and s.free_blocks == s.total_blocks


async def test_requests_on_one_session_stream_what_generate_calls_do(
        make_engine: Any, prompt_ids: list[list[int]]) -> None:
    async with serve(make_engine) as served:
        async with client(served.address, sessions=False) as (calls, per_call):
            expected = [await tokens(calls, request(f"c{i}", p)) for i, p in enumerate(prompt_ids)]
        async with client(served.address) as (sessions, counted):
            got = await asyncio.gather(*(tokens(sessions, request(f"s{i}", p))
                                         for i, p in enumerate(prompt_ids)))
            again = await tokens(sessions, request("again", prompt_ids[0]))
        assert got == expected and again == expected[0]
        assert all(len(t) == 6 for t in got)
        assert per_call.calls == {"Generate": len(prompt_ids)}
        assert counted.calls == {"Session": 1}  # every request a message on one call
        await until(lambda: all_free(served.worker))


async def test_leaving_a_request_cancels_it_alone(make_engine: Any,
                                                  prompt_ids: list[list[int]]) -> None:
    async with serve(make_engine) as served, client(served.address) as (c, counted):
        long = request("long", prompt_ids[0], max_tokens=400)
        async with contextlib.aclosing(c.generate(long, **TIMEOUTS)) as events:
            async for ev in events:
                if ev.num_output_tokens >= 2:
                    break  # the consumer leaves mid-stream
        await until(lambda: all_free(served.worker))  # cancelled on the worker, blocks freed
        assert await tokens(c, request("after", prompt_ids[1])) != []
        assert counted.calls == {"Session": 1}


async def test_a_failed_request_fails_alone_as_its_generate_call_would(
        make_engine: Any, prompt_ids: list[list[int]]) -> None:
    too_long = request("too-long", [5] * 10, max_tokens=10**6)
    async with serve(make_engine) as served:
        async with client(served.address, sessions=False) as (calls, _):
            with pytest.raises(InvalidRequestError) as by_call:
                await tokens(calls, too_long)
        async with client(served.address) as (c, counted):
            ok = asyncio.ensure_future(tokens(c, request("fine", prompt_ids[0], 12)))
            with pytest.raises(InvalidRequestError) as by_session:
                await tokens(c, too_long)
            assert len(await ok) == 12
            assert counted.calls == {"Session": 1}
        assert type(by_session.value) is type(by_call.value)
        assert by_session.value.code == by_call.value.code
        assert by_session.value.param == by_call.value.param
        assert str(by_session.value) == str(by_call.value)
        await until(lambda: all_free(served.worker))


async def test_a_worker_without_session_gets_a_call_per_request(
        make_engine: Any, prompt_ids: list[list[int]]) -> None:
    async with serve(make_engine, NoSession) as served, client(served.address) as (c, counted):
        first = await tokens(c, request("a", prompt_ids[0]))
        second = await tokens(c, request("b", prompt_ids[0]))
        assert first == second and len(first) == 6
        assert counted.calls == {"Session": 1, "Generate": 2}  # asked once, then calls


async def test_a_session_that_fails_before_any_reply_falls_back_to_calls(
        make_engine: Any, prompt_ids: list[list[int]]) -> None:
    """INTERNAL before any reply: the worker may be an older one whose UNIMPLEMENTED grpc.aio
    lost; the request is served by a Generate call, and later ones too."""
    async with serve(make_engine, LostStatus) as served, client(served.address) as (c, counted):
        first = await tokens(c, request("a", prompt_ids[0]))
        second = await tokens(c, request("b", prompt_ids[0]))
        assert first == second and len(first) == 6
        assert counted.calls == {"Session": 1, "Generate": 2}
        await until(lambda: all_free(served.worker))


async def test_a_worker_upgraded_in_place_is_offered_a_session_again(
        make_engine: Any, prompt_ids: list[list[int]], monkeypatch: pytest.MonkeyPatch) -> None:
    """An older worker is replaced by a newer one at the same address, under the same id:
    once SESSION_RETRY_S has passed, the router's client offers a Session again."""
    monkeypatch.setattr(router_clients, "SESSION_RETRY_S", 0.0)
    async with serve(make_engine, NoSession) as old:
        async with client(old.address) as (c, counted):
            first = await tokens(c, request("a", prompt_ids[0]))
            assert counted.calls == {"Session": 1, "Generate": 1}
            await old.server.stop(0)
            port = int(old.address.rsplit(":", 1)[1])
            async with serve(make_engine, port=port) as new:
                assert new.address == old.address
                again = await tokens(c, request("b", prompt_ids[0]))
                assert again == first
                assert counted.calls == {"Session": 2, "Generate": 1}
                await until(lambda: all_free(new.worker))


def test_framed_requests_join_into_one_sessionrequests_message() -> None:
    """The writer's message is its queued requests' encodings joined: byte for byte the
    SessionRequests that holds them, lengths of one byte and of several."""
    from pdserve.v1 import decode_pb2

    big = decode_pb2.SessionRequest(stream=3)
    big.generate.input.prompt_token_ids.extend(range(40_000))
    msgs = [decode_pb2.SessionRequest(stream=1, cancel=True),
            decode_pb2.SessionRequest(stream=2**40, cancel=True), big]
    joined = b"".join(router_clients._framed(m) for m in msgs)
    assert joined == decode_pb2.SessionRequests(requests=msgs).SerializeToString()
    assert list(decode_pb2.SessionRequests.FromString(joined).requests) == msgs


async def test_draining_ends_sessions_after_their_requests(
        make_engine: Any, prompt_ids: list[list[int]]) -> None:
    async with serve(make_engine) as served, client(served.address) as (c, _):
        running = asyncio.ensure_future(tokens(c, request("running", prompt_ids[0], 40)))
        await until(lambda: served.worker.active_streams == 1)
        served.servicer.end_sessions()
        assert len(await running) == 40  # a request already there finishes
        await until(lambda: not served.servicer._sessions)  # then its session ends, OK
        with pytest.raises(CapacityError) as refused:  # a new one is placed elsewhere
            await tokens(c, request("late", prompt_ids[1]))
        assert refused.value.code == ErrorCode.WORKER_UNAVAILABLE
        # Refused on its session, or the session ended; or its write raced the end, and
        # grpc.aio ended the call INTERNAL on this side in place of the worker's OK.
        assert "draining" in str(refused.value) or "Internal error from Core" in str(
            refused.value)
        await until(lambda: all_free(served.worker))


async def test_a_session_that_breaks_fails_its_requests_as_worker_unavailable(
        make_engine: Any, prompt_ids: list[list[int]]) -> None:
    async with serve(make_engine) as served, client(served.address) as (c, _):
        running = asyncio.ensure_future(tokens(c, request("cut", prompt_ids[0], 400)))
        await until(lambda: served.worker.active_streams == 1)
        await served.server.stop(0)  # the worker's server goes away mid-stream
        with pytest.raises(CapacityError) as lost:
            await running
        assert lost.value.code == ErrorCode.WORKER_UNAVAILABLE
        await until(lambda: all_free(served.worker))  # the worker cancelled it too


async def test_replies_queued_together_leave_in_one_message() -> None:
    """The chunks of one engine step for many requests are one SessionResponses message."""
    from pdserve.v1 import decode_pb2

    session = decode_servicer._Session(None)  # type: ignore[arg-type]  # no request starts
    for stream in (1, 2, 3):
        session._out.put_nowait(decode_pb2.SessionResponse(stream=stream))
    session._out.put_nowait(None)  # then the call ends

    async def silent() -> AsyncIterator[decode_pb2.SessionRequests]:
        await asyncio.Event().wait()
        yield decode_pb2.SessionRequests()

    batches = [b async for b in session.run(silent())]
    assert [[r.stream for r in b.responses] for b in batches] == [[1, 2, 3]]

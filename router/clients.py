"""Typed clients for the worker services: the router's only way to talk to a worker.

`DecodeClient` and `PrefillClient` speak domain types (`GenerateRequest`, `TokenEvent`,
`KVDestination`, `PrefillReport`, `WorkerLoad`) and own everything about the wire: protobuf
conversion, deadlines, call metadata (`x-request-id`, plus any pairs the caller configures,
e.g. auth), cancelling a stream the caller leaves, and turning gRPC failures into the
project's exceptions (`pdserve.errors`: CapacityError when a worker is busy or gone,
KVTransferError, TimeoutError past a deadline, ...). Nothing outside this module and the
servicers sees a `_pb2` message or a `grpc.aio.AioRpcError`.

A decode client sends its local requests (`generate`) as messages on one long-lived
`DecodeWorker.Session` call (`_Session`) instead of a call each: no HTTP/2 stream, headers or
server call is set up per request, and what either side has queued travels as one message.
A worker that does not serve Session (an older version) gets a Generate call per request, as
does every request with `sessions=False`; it is offered a Session again every
`SESSION_RETRY_S` (it may have been upgraded in place, same address and id).

`WorkerChannels` keeps one channel per worker address and hands out clients on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import TypeVar, cast

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.control.load import WorkerLoad
from pdserve.control.workers import WorkerInfo
from pdserve.errors import CapacityError, ErrorCode, WorkerTimeoutError
from pdserve.kv_layout import KVDestination
from pdserve.rpc import convert
from pdserve.rpc.errors import error_from_rpc, error_from_status
from pdserve.rpc.metadata import request_id_metadata
from pdserve.rpc.tls import TLSConfig
from pdserve.rpc.transport import channel
from pdserve.types import GenerateRequest, PrefillReport, TokenEvent
from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from router.timings import OWN, OwnTime

Metadata = tuple[tuple[str, str], ...]
# A decode worker that answered Session UNIMPLEMENTED is offered one again after this long.
SESSION_RETRY_S = 300.0
_SESSION_METHOD = "/{}/Session".format(
    decode_pb2.DESCRIPTOR.services_by_name["DecodeWorker"].full_name)
T = TypeVar("T")
C = TypeVar("C", bound="_Client")  # WorkerChannels hands out one kind per role


class _Client:
    def __init__(self, channel: grpc.aio.Channel, *, worker_id: str = "",
                 metadata: Iterable[tuple[str, str]] = ()):
        self.worker_id = worker_id
        self._metadata: Metadata = tuple(metadata)
        self._health = health_pb2_grpc.HealthStub(channel)

    async def alive(self, *, timeout_s: float) -> bool:
        """Whether the worker process answers at all (grpc.health.v1, served by its event
        loop: unlike Stats it never waits for an engine step). A draining worker answers
        NOT_SERVING and is alive; no answer within `timeout_s` is False."""
        try:
            # HealthStub's stubs omit the methods it sets up per channel (types-grpcio-health).
            await self._health.Check(health_pb2.HealthCheckRequest(service=""),  # type: ignore[attr-defined]
                                     timeout=timeout_s, metadata=self._md())
            return True
        except grpc.aio.AioRpcError:
            return False

    def _md(self, request_id: str | None = None) -> Metadata:
        if request_id is None:
            return self._metadata
        return request_id_metadata(request_id, self._metadata)


class DecodeClient(_Client):
    """One decode worker (`pdserve.v1.DecodeWorker`). With `sessions` (the default) local
    requests travel on one Session call, opened at the first and again after it ends."""

    def __init__(self, channel: grpc.aio.Channel, *, worker_id: str = "",
                 metadata: Iterable[tuple[str, str]] = (), sessions: bool = True):
        super().__init__(channel, worker_id=worker_id, metadata=metadata)
        self._channel = channel
        self._stub = decode_pb2_grpc.DecodeWorkerStub(channel)
        self._sessions = sessions
        self._session_retry_at: float | None = None  # set while the worker refuses Session
        self._session: _Session | None = None

    async def cached_prefix(self, token_ids: tuple[int, ...] | list[int], *,
                            timeout_s: float) -> int:
        """Leading tokens of a prompt already in the worker's prefix cache."""
        resp = await _unary(self._stub.CachedPrefix(
            decode_pb2.CachedPrefixRequest(token_ids=token_ids), timeout=timeout_s,
            metadata=self._md()))
        return int(resp.num_cached_tokens)

    def generate(self, req: GenerateRequest, *, first_token_timeout_s: float,
                 token_timeout_s: float) -> AsyncGenerator[TokenEvent, None]:
        """Prefill locally and decode; closing the iterator cancels the request."""
        if self._sessions and (self._session_retry_at is None
                               or time.monotonic() >= self._session_retry_at):
            return self._session_events(req, first_token_timeout_s, token_timeout_s)
        return self._call_events(req, first_token_timeout_s, token_timeout_s)

    def _call_events(self, req: GenerateRequest, first_token_timeout_s: float,
                     token_timeout_s: float) -> AsyncGenerator[TokenEvent, None]:
        call = self._stub.Generate(decode_pb2.DecodeGenerateRequest(
            input=convert.input_to_proto(req)), metadata=self._md(req.request_id))
        if (own := OWN.get()) is not None:
            own.forward(time.perf_counter())  # grpc sends it with the call's first read
        return _events(call, first_token_timeout_s, token_timeout_s)

    async def _session_events(self, req: GenerateRequest, first_token_timeout_s: float,
                              token_timeout_s: float) -> AsyncGenerator[TokenEvent, None]:
        session = self._session
        if session is None or session.ended is not None:
            session = self._session = _Session(self._channel, self._md())
            self._session_retry_at = None
        try:
            async with contextlib.aclosing(session.events(
                    req, first_token_timeout_s, token_timeout_s)) as events:
                async for ev in events:
                    yield ev
            return
        except _SessionUnsupported:
            # An older worker: a call per request until it is offered a Session again.
            self._session_retry_at = time.monotonic() + SESSION_RETRY_S
        async with contextlib.aclosing(self._call_events(
                req, first_token_timeout_s, token_timeout_s)) as events:
            async for ev in events:
                yield ev

    def close(self) -> None:
        """Cancel the Session call, if one is open (its requests fail WORKER_UNAVAILABLE)."""
        if self._session is not None:
            self._session.close()

    def generate_remote(self, req: GenerateRequest, *, lease_s: float,
                        allocate_timeout_s: float, transfer_timeout_s: float,
                        token_timeout_s: float) -> RemoteStream:
        """Open the worker's AllocateAndGenerate stream for `req`, whose KV a prefill worker
        will write: `allocation()` is where (within `allocate_timeout_s`; the blocks wait
        `lease_s` for a writer), then `events()` decodes from the KV's arrival on (within
        `transfer_timeout_s` of the allocation). `close()` cancels the call: the worker then
        fences the transfer and frees the blocks."""
        call = self._stub.AllocateAndGenerate(
            decode_pb2.AllocateAndGenerateRequest(
                input=convert.input_to_proto(req), lease_ms=int(lease_s * 1000),
                transfer_timeout_ms=int(transfer_timeout_s * 1000)),
            metadata=self._md(req.request_id))
        return RemoteStream(call, req.request_id, allocate_timeout_s=allocate_timeout_s,
                            transfer_timeout_s=transfer_timeout_s,
                            token_timeout_s=token_timeout_s)

    async def abort(self, request_id: str, *, timeout_s: float = 5.0) -> bool:
        """Cancel a request in any state; returns once its blocks are fenced and freed.
        False when the worker does not hold it, or has left (its channel is closed)."""
        try:
            call = self._stub.Abort(common_pb2.AbortRequest(request_id=request_id),
                                    timeout=timeout_s, metadata=self._md(request_id))
        except grpc.aio.UsageError:  # the directory closed the channel: the worker is gone
            return False
        return bool((await _unary(call)).found)

    async def stats(self, *, timeout_s: float = 10.0) -> WorkerLoad:
        """The worker's load, fresh from its engine (the numbers its Stats message carries)."""
        return convert.load_from_decode_stats(await _unary(self._stub.Stats(
            common_pb2.StatsRequest(), timeout=timeout_s, metadata=self._md())))


class PrefillClient(_Client):
    """One prefill worker (`pdserve.v1.PrefillWorker`)."""

    def __init__(self, channel: grpc.aio.Channel, *, worker_id: str = "",
                 metadata: Iterable[tuple[str, str]] = ()):
        super().__init__(channel, worker_id=worker_id, metadata=metadata)
        self._stub = prefill_pb2_grpc.PrefillWorkerStub(channel)

    async def prefill(self, req: GenerateRequest, destination: KVDestination | None, *,
                      timeout_s: float) -> PrefillReport:
        """Prefill `req` and write its KV into `destination` (None: keep it there). The first
        token goes to the destination with the KV, not back here. Cancelling the call drops
        the request on the worker."""
        dest = None if destination is None else convert.destination_to_proto(destination)
        resp = await _unary(self._stub.Prefill(
            prefill_pb2.PrefillRequest(input=convert.input_to_proto(req), destination=dest,
                                       deadline_ms=int(timeout_s * 1000)),
            timeout=timeout_s, metadata=self._md(req.request_id)))
        return convert.prefill_report_from_proto(resp, self.worker_id)

    async def stats(self, *, timeout_s: float = 10.0) -> WorkerLoad:
        """The worker's load, fresh from its engine (the numbers its Stats message carries)."""
        return convert.load_from_prefill_stats(await _unary(self._stub.Stats(
            common_pb2.StatsRequest(), timeout=timeout_s, metadata=self._md())))


async def _unary(call: Awaitable[T]) -> T:
    """The reply of a unary call, its failure as the project's exception."""
    try:
        return await call
    except grpc.aio.AioRpcError as exc:
        raise error_from_rpc(exc) from exc


def _chunk(msg: object) -> decode_pb2.TokenChunk:
    # grpc's stubs type read() as `object` (their EOF alias): past EOF it is a message.
    return cast(decode_pb2.TokenChunk, msg)


def _remote_chunk(msg: object) -> decode_pb2.TokenChunk:
    """The token of an AllocateAndGenerate message after the first."""
    resp = cast(decode_pb2.AllocateAndGenerateResponse, msg)
    if resp.WhichOneof("kind") != "token":
        raise CapacityError("decode stream sent an allocation where a token was due",
                            code=ErrorCode.WORKER_UNAVAILABLE)
    return resp.token


async def _events(call: grpc.aio.UnaryStreamCall, first_timeout_s: float,
                  token_timeout_s: float,
                  chunk_of: Callable[[object], decode_pb2.TokenChunk] = _chunk
                  ) -> AsyncGenerator[TokenEvent, None]:
    """TokenEvents of a decode stream, up to the final one; every wait bounded; the call is
    cancelled however the consumer leaves."""
    own = OWN.get()
    try:
        timeout = first_timeout_s
        while True:
            msg = await _read(call, timeout)
            if own is not None and not own.replied:
                own.reply(time.perf_counter())
            ev = convert.token_event_from_chunk(chunk_of(msg))
            yield ev
            if ev.finished:
                return
            timeout = token_timeout_s
    except grpc.aio.AioRpcError as exc:
        raise error_from_rpc(exc) from exc
    finally:
        call.cancel()


async def _read(call: grpc.aio.UnaryStreamCall, timeout_s: float) -> object:
    """A decode stream's next message within `timeout_s` (else WorkerTimeoutError); a stream
    that ends here, before its final token, is CapacityError (the worker went away)."""
    try:
        async with asyncio.timeout(timeout_s):  # no task per message, as wait_for makes
            msg = await call.read()
    except TimeoutError as exc:
        raise WorkerTimeoutError(f"decode worker sent nothing for {timeout_s:.0f}s") from exc
    if msg is grpc.aio.EOF:
        raise CapacityError("decode stream ended without a final token",
                            code=ErrorCode.WORKER_UNAVAILABLE)
    return msg


class _SessionUnsupported(Exception):
    """The worker answered Session UNIMPLEMENTED (or its answer was lost before any reply):
    no request on the call runs there."""




class _Session:
    """The router's side of one DecodeWorker.Session call. Every request is a message on it
    (`events`); one reader task hands each reply to its request's queue, and one writer task
    sends what requests queued (all of it in one message), so starting or cancelling a
    request never waits. The call's
    end, for whatever reason, ends every request on it (CapacityError: the router places
    them again, as it does when a Generate call fails)."""

    def __init__(self, channel: grpc.aio.Channel, metadata: Metadata) -> None:
        # Requests go out already encoded (`_framed`): each is serialized once, in its own
        # coroutine, and the writer joins what is queued into one SessionRequests message
        # without copying a prompt into a message again.
        self._call = channel.stream_stream(
            _SESSION_METHOD, request_serializer=bytes,
            response_deserializer=decode_pb2.SessionResponses.FromString)(metadata=metadata)
        # Each reply with when it was read (`OwnTime.reply`); None: the call ended.
        self._waiting: dict[int, asyncio.Queue[tuple[decode_pb2.SessionResponse, float] | None]
                            ] = {}
        self._ids = itertools.count(1)
        self._out: asyncio.Queue[tuple[bytes, OwnTime | None]] = asyncio.Queue()
        self.ended: str | None = None  # why the call ended, once it has
        self._unsupported = False
        loop = asyncio.get_running_loop()
        self._writer = loop.create_task(self._write())
        self._reader = loop.create_task(self._read())

    async def _write(self) -> None:
        # A write that fails, or finds the call over, ends the writer: the reader reports why.
        with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError,
                                 asyncio.InvalidStateError):
            out = self._out
            while True:
                batch = [await out.get()]
                while not out.empty():
                    batch.append(out.get_nowait())
                body = b"".join([framed for framed, _ in batch])
                # On its way from here: grpc writes the bytes to the socket on this thread
                # as it takes them; the write's completion comes back later, through grpc's
                # poller thread, and delays no request (`OwnTime`).
                now = time.perf_counter()
                for _, own in batch:
                    if own is not None:
                        own.forward(now)
                await self._call.write(body)

    async def _read(self) -> None:
        why = "the decode worker ended the session (it is draining)"
        replied = False
        try:
            while (msg := await self._call.read()) is not grpc.aio.EOF:
                now = time.perf_counter()
                replied = True
                for reply in cast(decode_pb2.SessionResponses, msg).responses:
                    if (waiting := self._waiting.get(reply.stream)) is not None:
                        waiting.put_nowait((reply, now))
        except grpc.aio.AioRpcError as exc:
            # An older worker answers UNIMPLEMENTED. Grpc.aio may report that as INTERNAL
            # instead, when our first write races the call's end (grpc/grpc#36066: the failed
            # write overwrites the status the worker sent), so INTERNAL before any reply
            # counts as the same answer: each request goes as a Generate call instead (one
            # that did reach the worker was cancelled there when the call ended).
            self._unsupported = exc.code() == grpc.StatusCode.UNIMPLEMENTED or (
                exc.code() == grpc.StatusCode.INTERNAL and not replied)
            why = f"the session with the decode worker failed: {error_from_rpc(exc)}"
        finally:
            self.ended = why
            self._writer.cancel()
            for waiting in self._waiting.values():
                waiting.put_nowait(None)

    def close(self) -> None:
        self._call.cancel()

    async def events(self, req: GenerateRequest, first_timeout_s: float,
                     token_timeout_s: float) -> AsyncGenerator[TokenEvent, None]:
        """`req`'s events on this call, up to the final one; every wait bounded; leaving
        before the final one cancels the request on the worker."""
        stream = next(self._ids)
        waiting = self._waiting[stream] = asyncio.Queue()
        over = False
        own = OWN.get()
        try:
            if self.ended is not None:
                waiting.put_nowait(None)
            else:
                msg = decode_pb2.SessionRequest(stream=stream)
                convert.fill_input(msg.generate.input, req)
                self._out.put_nowait((_framed(msg), own))
            timeout = first_timeout_s
            while True:
                try:
                    async with asyncio.timeout(timeout):
                        item = await waiting.get()
                except TimeoutError as exc:
                    raise WorkerTimeoutError(
                        f"decode worker sent nothing for {timeout:.0f}s") from exc
                if item is None:
                    over = True
                    if self._unsupported:
                        raise _SessionUnsupported
                    raise CapacityError(f"{self.ended} before the final token",
                                        code=ErrorCode.WORKER_UNAVAILABLE)
                reply, read_at = item
                if own is not None:
                    own.reply(read_at)
                if reply.WhichOneof("kind") == "error":
                    over = True
                    e = reply.error
                    raise error_from_status(e.status, e.message, e.code or None,
                                            e.param or None)
                ev = convert.token_event_from_chunk(reply.token)
                over = ev.finished
                yield ev
                if over:
                    return
                timeout = token_timeout_s
        finally:
            del self._waiting[stream]
            if not over and self.ended is None:
                self._out.put_nowait((_framed(decode_pb2.SessionRequest(
                    stream=stream, cancel=True)), None))


def _framed(msg: decode_pb2.SessionRequest) -> bytes:
    """`msg` encoded as one element of `SessionRequests.requests` (field 1, length-delimited):
    SessionRequests is the concatenation of its elements so encoded."""
    body = msg.SerializeToString()
    head = bytearray(b"\x0a")  # field 1, wire type 2
    n = len(body)
    while n >= 0x80:  # the length as a base-128 varint
        head.append(n & 0x7F | 0x80)
        n >>= 7
    head.append(n)
    return bytes(head) + body


class RemoteStream:
    """One request's AllocateAndGenerate stream (`DecodeClient.generate_remote`): its first
    message is the allocation, every later one a token. Read `allocation()` once, then
    `events()`; `close()` (idempotent) cancels the call however far it got."""

    def __init__(self, call: grpc.aio.UnaryStreamCall, request_id: str, *,
                 allocate_timeout_s: float, transfer_timeout_s: float,
                 token_timeout_s: float) -> None:
        self.request_id = request_id
        self._call = call
        self._allocate_timeout_s = allocate_timeout_s
        self._transfer_timeout_s = transfer_timeout_s
        self._token_timeout_s = token_timeout_s

    async def allocation(self) -> KVDestination:
        """Where the prefill worker writes the KV. CapacityError when the worker cannot
        reserve the blocks now (or does not serve this RPC: an older version), and
        WorkerTimeoutError past the allocation's own timeout."""
        try:
            msg = cast(decode_pb2.AllocateAndGenerateResponse,
                       await _read(self._call, self._allocate_timeout_s))
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                raise CapacityError("decode worker does not serve AllocateAndGenerate",
                                    code=ErrorCode.REMOTE_UNSUPPORTED) from exc
            raise error_from_rpc(exc) from exc
        if msg.WhichOneof("kind") != "allocation":
            raise CapacityError("decode stream did not start with its allocation",
                                code=ErrorCode.WORKER_UNAVAILABLE)
        return convert.destination_from_allocate_response(self.request_id, msg.allocation)

    def events(self) -> AsyncIterator[TokenEvent]:
        """The request's events, from the first token (within the transfer timeout of the
        allocation) on; leaving them cancels the call."""
        return _events(self._call, self._transfer_timeout_s, self._token_timeout_s,
                       _remote_chunk)

    def close(self) -> None:
        self._call.cancel()


class WorkerChannels:
    """One channel per worker address, closed when the worker leaves; clients on them.

    `metadata` is sent with every call (e.g. an authorization pair); `interceptors` wrap every
    call (tests count RPCs with them); with `tls` every channel is TLS, the router's
    certificate presented to the workers (they require one) and theirs checked against its CA."""

    def __init__(self, metadata: Iterable[tuple[str, str]] = (), *,
                 interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
                 tls: TLSConfig | None = None, sessions: bool = True) -> None:
        self._tls = tls
        self._sessions = sessions  # decode clients' local requests on a Session call
        self._channels: dict[str, grpc.aio.Channel] = {}
        # Clients by (address, worker id), kept with their channel: a client's stubs make a
        # callable per RPC method, too much to build again for every request.
        self._decode: dict[tuple[str, str], DecodeClient] = {}
        self._prefill: dict[tuple[str, str], PrefillClient] = {}
        self._closing: set[asyncio.Task[None]] = set()
        self._metadata: Metadata = tuple(metadata)
        self._interceptors = tuple(interceptors)

    def _channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = channel(address, tls=self._tls,
                                                   interceptors=self._interceptors)
        return ch

    def decode(self, w: WorkerInfo) -> DecodeClient:
        return self._client(self._decode, functools.partial(DecodeClient,
                                                            sessions=self._sessions), w)

    def prefill(self, w: WorkerInfo) -> PrefillClient:
        return self._client(self._prefill, PrefillClient, w)

    def _client(self, clients: dict[tuple[str, str], C], make: Callable[..., C],
                w: WorkerInfo) -> C:
        key = (w.grpc_address, w.worker_id)
        if (client := clients.get(key)) is None:
            client = clients[key] = make(self._channel(w.grpc_address), worker_id=w.worker_id,
                                         metadata=self._metadata)
        return client

    def drop(self, address: str, grace_s: float) -> None:
        """Stop handing out the channel; streams still on it (a draining worker finishing
        its requests) get ``grace_s`` before the channel closes."""
        ch = self._channels.pop(address, None)
        for clients in (self._decode, self._prefill):
            for key in [k for k in clients if k[0] == address]:
                del clients[key]
        if ch is not None:
            task = asyncio.get_running_loop().create_task(ch.close(grace=grace_s))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        for address in list(self._channels):
            self.drop(address, grace_s=1.0)
        if self._closing:
            await asyncio.wait(self._closing, timeout=5)


__all__ = ["DecodeClient", "PrefillClient", "RemoteStream", "WorkerChannels"]

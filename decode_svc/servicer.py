"""gRPC adapter for DecodeWorker: protobuf in, domain call, protobuf out.

Requests are validated like the router's (`convert.request_from_proto`: request id, sampling,
prompt plus max_tokens within this engine's context); client mistakes are INVALID_ARGUMENT.
`Session` carries many Generate requests on one call (decode.proto): each runs as Generate
would, its failure reported in a message instead of the call's status.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import structlog

from decode_svc.worker import DecodeWorker
from pdserve.errors import CapacityError, ErrorCode, InvalidRequestError
from pdserve.kv_layout import KVDestination
from pdserve.rpc import convert
from pdserve.rpc.errors import reported
from pdserve.runtime import logs_request_id
from pdserve.types import GenerateRequest, check_request_id
from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc


class DecodeServicer(decode_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, worker: DecodeWorker):
        self.worker = worker
        self._sessions: set[_Session] = set()
        self._ending = False

    def end_sessions(self) -> None:
        """Draining: every Session call ends (OK) once no request is left on it; a request
        started on one, or as a Generate call, from now on is refused (UNAVAILABLE: the
        router places it elsewhere)."""
        self._ending = True
        for session in list(self._sessions):
            session.end()

    async def Session(self, requests: AsyncIterator[decode_pb2.SessionRequests],
                      context: grpc.aio.ServicerContext
                      ) -> AsyncIterator[decode_pb2.SessionResponses]:
        session = _Session(self)
        self._sessions.add(session)
        try:
            if self._ending:
                session.end()
            async for msg in session.run(requests):
                yield msg
        finally:
            self._sessions.discard(session)

    def _request(self, msg: decode_pb2.DecodeGenerateRequest | decode_pb2.AllocateRequest
                 | decode_pb2.AllocateAndGenerateRequest) -> GenerateRequest:
        return convert.request_from_proto(msg.input, self.worker.engine.max_model_len)

    @logs_request_id
    async def Generate(self, request: decode_pb2.DecodeGenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[decode_pb2.TokenChunk]:
        req = self._request(request)
        if self._ending:
            # Refused as a session's request is: a router whose session call ended in a race
            # with its write (INTERNAL before any reply) sends the request as a call instead.
            raise self.draining_error()
        async for ev in self.worker.generate(req):
            yield convert.token_event_to_chunk(ev)

    def draining_error(self) -> CapacityError:
        return CapacityError(f"decode worker {self.worker.worker_id} is draining",
                             code=ErrorCode.WORKER_UNAVAILABLE)

    @logs_request_id
    async def AllocateAndGenerate(self, request: decode_pb2.AllocateAndGenerateRequest,
                                  context: grpc.aio.ServicerContext
                                  ) -> AsyncIterator[decode_pb2.AllocateAndGenerateResponse]:
        req = self._request(request)
        lease = request.lease_ms / 1000 if request.lease_ms else None  # capped by the worker
        timeout = request.transfer_timeout_ms / 1000 if request.transfer_timeout_ms else 30.0
        # aclosing: a caller that leaves (cancelled at a yield) fences and frees the blocks now.
        async with contextlib.aclosing(self.worker.allocate_and_generate(
                req, lease_s=lease, timeout_s=timeout)) as items:
            async for item in items:
                if isinstance(item, KVDestination):
                    yield decode_pb2.AllocateAndGenerateResponse(
                        allocation=convert.destination_to_allocate_response(item))
                else:
                    yield decode_pb2.AllocateAndGenerateResponse(
                        token=convert.token_event_to_chunk(item))

    # Deprecated (decode.proto): served one more release for routers that still call them.
    @logs_request_id
    async def AllocateRemote(self, request: decode_pb2.AllocateRequest,
                             context: grpc.aio.ServicerContext) -> decode_pb2.AllocateResponse:
        req = self._request(request)
        lease = request.lease_ms / 1000 if request.lease_ms else None  # capped by the worker
        slot = await self.worker.allocate_remote(req, lease)
        return convert.destination_to_allocate_response(slot)

    @logs_request_id
    async def GenerateRemote(self, request: decode_pb2.RemoteGenerateRequest,
                             context: grpc.aio.ServicerContext
                             ) -> AsyncIterator[decode_pb2.TokenChunk]:
        check_request_id(request.request_id)
        timeout = request.transfer_timeout_ms / 1000 if request.transfer_timeout_ms else 30.0
        async for ev in self.worker.generate_remote(request.request_id, request.transfer_id,
                                                    timeout_s=timeout):
            yield convert.token_event_to_chunk(ev)

    @logs_request_id
    async def Abort(self, request: common_pb2.AbortRequest,
                    context: grpc.aio.ServicerContext) -> common_pb2.AbortResponse:
        return common_pb2.AbortResponse(
            found=await self.worker.abort(check_request_id(request.request_id)))

    async def CachedPrefix(self, request: decode_pb2.CachedPrefixRequest,
                           context: grpc.aio.ServicerContext) -> decode_pb2.CachedPrefixResponse:
        n = await self.worker.cached_prefix(list(request.token_ids))
        return decode_pb2.CachedPrefixResponse(num_cached_tokens=n)

    async def Stats(self, request: common_pb2.StatsRequest,
                    context: grpc.aio.ServicerContext) -> decode_pb2.DecodeStats:
        load = self.worker.load(await self.worker.engine.stats())
        return convert.decode_stats_to_proto(self.worker.worker_id, load,
                                             self.worker.engine.layout)


class _Session:
    """One Session call: each request it starts runs in a task of its own, whose chunks (or
    error) go onto one queue that the call writes from, everything queued in one message. The
    call ending, however it ends, cancels the requests still running: their blocks are freed
    as a cancelled Generate's."""

    def __init__(self, servicer: DecodeServicer) -> None:
        self._servicer = servicer
        self._out: asyncio.Queue[decode_pb2.SessionResponse | None] = asyncio.Queue()
        self._running: dict[int, asyncio.Task[None]] = {}
        self._reading = True
        self._ending = False
        self._failed: Exception | None = None  # the caller broke the protocol

    def end(self) -> None:
        self._ending = True
        self._maybe_done()

    def _maybe_done(self) -> None:
        if (self._ending or not self._reading) and not self._running:
            self._out.put_nowait(None)

    async def run(self, requests: AsyncIterator[decode_pb2.SessionRequests]
                  ) -> AsyncIterator[decode_pb2.SessionResponses]:
        reader = asyncio.get_running_loop().create_task(self._read(requests))
        out = self._out
        try:
            done = False
            while not done:
                batch = []
                item = await out.get()
                while item is not None:
                    batch.append(item)
                    if out.empty():
                        break
                    item = out.get_nowait()
                done = item is None
                if batch:
                    yield decode_pb2.SessionResponses(responses=batch)
            if self._failed is not None:
                raise self._failed
        finally:
            reader.cancel()
            for task in list(self._running.values()):
                task.cancel()

    async def _read(self, requests: AsyncIterator[decode_pb2.SessionRequests]) -> None:
        try:
            async for batch in requests:
                for msg in batch.requests:
                    kind = msg.WhichOneof("kind")
                    if kind == "generate":
                        self._start(msg.stream, msg.generate)
                    elif kind == "cancel" and (task := self._running.get(msg.stream)):
                        task.cancel()
        except InvalidRequestError as exc:  # the call ends now; `run` cancels what runs
            self._failed = exc
            self._out.put_nowait(None)
        finally:
            self._reading = False
            self._maybe_done()

    def _start(self, stream: int, msg: decode_pb2.DecodeGenerateRequest) -> None:
        if stream in self._running:
            raise InvalidRequestError(f"session stream {stream} is already running",
                                      code=ErrorCode.INVALID_MESSAGE)
        if self._ending:
            self._reply_error(stream, self._servicer.draining_error(), None)
            return
        task = asyncio.get_running_loop().create_task(self._generate(stream, msg))
        self._running[stream] = task

        def done(_: asyncio.Task[None]) -> None:
            del self._running[stream]
            self._maybe_done()
        task.add_done_callback(done)

    async def _generate(self, stream: int, msg: decode_pb2.DecodeGenerateRequest) -> None:
        request_id = None
        try:
            req = self._servicer._request(msg)
            request_id = req.request_id
            with structlog.contextvars.bound_contextvars(request_id=request_id):
                async with contextlib.aclosing(self._servicer.worker.generate(req)) as events:
                    async for ev in events:
                        self._out.put_nowait(decode_pb2.SessionResponse(
                            stream=stream, token=convert.token_event_to_chunk(ev)))
        except Exception as exc:  # reported as a Generate call's status would be
            self._reply_error(stream, exc, request_id)

    def _reply_error(self, stream: int, exc: Exception, request_id: str | None) -> None:
        status, message, code, param = reported(exc, "/pdserve.v1.DecodeWorker/Session",
                                                request_id)
        error = decode_pb2.SessionError(status=status.value[0], message=message, code=code,
                                        param=param or "")
        self._out.put_nowait(decode_pb2.SessionResponse(stream=stream, error=error))


def add_to_server(worker: DecodeWorker, server: grpc.aio.Server) -> DecodeServicer:
    """Serve ``worker`` as the pdserve.v1.DecodeWorker API on ``server``."""
    servicer = DecodeServicer(worker)
    decode_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, server)
    return servicer

"""gRPC adapter for DecodeWorker: protobuf in, domain call, protobuf out.

Requests are validated like the router's (`convert.request_from_proto`: request id, sampling,
prompt plus max_tokens within this engine's context); client mistakes are INVALID_ARGUMENT.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import grpc

from decode_svc.worker import DecodeWorker
from pdserve.kv_layout import KVDestination
from pdserve.rpc import convert
from pdserve.runtime import logs_request_id
from pdserve.types import GenerateRequest, check_request_id
from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc


class DecodeServicer(decode_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, worker: DecodeWorker):
        self.worker = worker

    def _request(self, msg: decode_pb2.DecodeGenerateRequest | decode_pb2.AllocateRequest
                 | decode_pb2.AllocateAndGenerateRequest) -> GenerateRequest:
        return convert.request_from_proto(msg.input, self.worker.engine.max_model_len)

    @logs_request_id
    async def Generate(self, request: decode_pb2.DecodeGenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[decode_pb2.TokenChunk]:
        req = self._request(request)
        async for ev in self.worker.generate(req):
            yield convert.token_event_to_chunk(ev)

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


def add_to_server(worker: DecodeWorker, server: grpc.aio.Server) -> None:
    """Serve ``worker`` as the pdserve.v1.DecodeWorker API on ``server``."""
    decode_pb2_grpc.add_DecodeWorkerServicer_to_server(DecodeServicer(worker), server)

"""gRPC adapter for PrefillWorker."""

from __future__ import annotations

import asyncio

import grpc

from pdserve.rpc import convert
from pdserve.runtime import logs_request_id
from pdserve.types import InvalidRequestError
from pdserve.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc
from prefill_svc.worker import Destination, PrefillWorker


class PrefillServicer(prefill_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, worker: PrefillWorker):
        self.worker = worker

    @logs_request_id
    async def Prefill(self, request: prefill_pb2.PrefillRequest,
                      context: grpc.aio.ServicerContext) -> prefill_pb2.PrefillResponse:
        req = convert.request_from_proto(request.input, self.worker.engine.max_model_len)
        dest = None
        if request.HasField("destination"):
            d = request.destination
            if not d.descriptor_id or not d.transfer_id or not d.block_ids:
                raise InvalidRequestError("destination needs descriptor_id, transfer_id and "
                                          "block_ids", param="destination")
            dest = Destination(d.descriptor_id, tuple(d.block_ids), d.num_cached_tokens,
                               d.transfer_id)
        coro = self.worker.prefill(req, dest)
        out = await (asyncio.wait_for(coro, request.deadline_ms / 1000)
                     if request.deadline_ms else coro)
        # The first token went to the destination with the KV (pdserve.handover), not here.
        return prefill_pb2.PrefillResponse(
            request_id=req.request_id,
            timings=common_pb2.StageTimings(queued_ms=out.queued_ms,
                                            prefill_compute_ms=out.compute_ms,
                                            kv_transfer_ms=out.transfer_ms),
            bytes_transferred=out.bytes_transferred,
            num_computed_tokens=out.num_computed_tokens, worker_id=self.worker.worker_id)

    async def Stats(self, request: common_pb2.StatsRequest,
                    context: grpc.aio.ServicerContext) -> prefill_pb2.PrefillStats:
        s = await self.worker.engine.stats()
        g = self.worker.gate
        return prefill_pb2.PrefillStats(
            worker_id=self.worker.worker_id, num_queued=g.num_waiting, num_running=g.active,
            num_queued_tokens=g.queued_tokens, num_total_blocks=s.total_blocks,
            num_free_blocks=s.free_blocks,
            layout=convert.kv_layout_to_proto(self.worker.engine.layout))


def add_to_server(worker: PrefillWorker, server: grpc.aio.Server) -> None:
    """Serve ``worker`` as the pdserve.v1.PrefillWorker API on ``server``."""
    prefill_pb2_grpc.add_PrefillWorkerServicer_to_server(PrefillServicer(worker), server)

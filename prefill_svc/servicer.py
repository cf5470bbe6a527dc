"""gRPC adapter for PrefillWorker."""

from __future__ import annotations

import asyncio

import grpc

from pdserve.rpc import convert
from pdserve.runtime import logs_request_id
from pdserve.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc
from prefill_svc.worker import PrefillWorker


class PrefillServicer(prefill_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, worker: PrefillWorker):
        self.worker = worker

    @logs_request_id
    async def Prefill(self, request: prefill_pb2.PrefillRequest,
                      context: grpc.aio.ServicerContext) -> prefill_pb2.PrefillResponse:
        req = convert.request_from_proto(request.input, self.worker.engine.max_model_len)
        dest = (convert.destination_from_proto(req.request_id, request.destination)
                if request.HasField("destination") else None)
        coro = self.worker.prefill(req, dest)
        report = await (asyncio.wait_for(coro, request.deadline_ms / 1000)
                        if request.deadline_ms else coro)
        # The first token went to the destination with the KV (pdserve.handover), not here.
        return convert.prefill_report_to_proto(req.request_id, report)

    async def Stats(self, request: common_pb2.StatsRequest,
                    context: grpc.aio.ServicerContext) -> prefill_pb2.PrefillStats:
        load = self.worker.load(await self.worker.engine.stats())
        return convert.prefill_stats_to_proto(self.worker.worker_id, load,
                                              self.worker.engine.layout)


def add_to_server(worker: PrefillWorker, server: grpc.aio.Server) -> None:
    """Serve ``worker`` as the pdserve.v1.PrefillWorker API on ``server``."""
    prefill_pb2_grpc.add_PrefillWorkerServicer_to_server(PrefillServicer(worker), server)

"""Helpers for tests that run a real local cluster (separate processes on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import grpc

from pdserve import grpc_util as gu
from pdserve.v1 import (
    common_pb2,
    decode_pb2_grpc,
    prefill_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
)

ROUTE_NAMES = {common_pb2.PREFILL_ROUTE_LOCAL: "local", common_pb2.PREFILL_ROUTE_REMOTE: "remote",
               common_pb2.PREFILL_ROUTE_FALLBACK: "fallback"}


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    route: str = ""
    decode_worker: str = ""
    prefill_worker: str = ""
    finish_reason: int = 0
    cached_tokens: int = 0
    timings: common_pb2.StageTimings | None = None


async def generate(address: str, ids: list[int], max_tokens: int = 32, *,
                   request_id: str = "", latency: str = "standard",
                   deadline_s: float = 300) -> Result:
    lat = {"interactive": common_pb2.LATENCY_CLASS_INTERACTIVE,
           "standard": common_pb2.LATENCY_CLASS_STANDARD,
           "batch": common_pb2.LATENCY_CLASS_BATCH}[latency]
    async with gu.insecure_channel(address) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        req = router_pb2.GenerateRequest(
            request_id=request_id, token_ids=router_pb2.TokenIds(ids=ids),
            sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0),
            latency_class=lat, return_timings=True)
        out = Result()
        async for resp in stub.Generate(req, timeout=deadline_s):
            out.tokens.extend(resp.token_ids)
            out.text += resp.text
            out.route = ROUTE_NAMES.get(resp.route, out.route)
            out.decode_worker = resp.decode_worker or out.decode_worker
            out.prefill_worker = resp.prefill_worker or out.prefill_worker
            out.cached_tokens = resp.usage.cached_tokens
            if resp.finish_reason:
                out.finish_reason = resp.finish_reason
                out.timings = resp.timings
        return out


async def worker_blocks(address: str, role: str) -> tuple[int, int]:
    """(free, total) KV blocks of a worker."""
    async with gu.insecure_channel(address) as ch:
        stub = (decode_pb2_grpc.DecodeWorkerStub(ch) if role == "decode"
                else prefill_pb2_grpc.PrefillWorkerStub(ch))
        s = await stub.Stats(common_pb2.StatsRequest(), timeout=10)
        return s.num_free_blocks, s.num_total_blocks


async def wait_blocks_free(address: str, role: str, timeout_s: float = 20) -> tuple[int, int]:
    deadline = time.monotonic() + timeout_s
    while True:
        free, total = await worker_blocks(address, role)
        if free == total or time.monotonic() > deadline:
            return free, total
        await asyncio.sleep(0.2)


def is_unavailable(exc: BaseException) -> bool:
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.UNAVAILABLE

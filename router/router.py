"""The router: per request, find cached prefixes, decide local vs remote prefill, pick
workers, and stream tokens back. Implements gateway.backend.GenerationBackend in-process."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import structlog
from prometheus_client import CollectorRegistry, Counter

from control.directory import WorkerDirectory
from control.registry import WorkerRegistry
from control.workers import WorkerInfo
from engine.tokenizer import Tokenizer
from engine.types import (
    CapacityError,
    FinishReason,
    GenerateRequest,
    KVTransferError,
    PdserveError,
    TokenEvent,
)
from pdserve import grpc_util as gu
from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from router.policy import (
    Decision,
    DecodeCandidate,
    Route,
    RouterPolicy,
    choose_decode,
    decide_route,
)

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class RouterConfig:
    policy: RouterPolicy = field(default_factory=RouterPolicy)
    cached_prefix_timeout_s: float = 0.25
    allocate_timeout_s: float = 5.0
    prefill_timeout_s: float = 30.0
    transfer_timeout_s: float = 30.0
    first_token_timeout_s: float = 120.0  # local prefill of a long prompt on a busy worker
    token_timeout_s: float = 60.0  # between two tokens of a running stream
    max_decode_attempts: int = 2
    drain_grace_s: float = 300.0  # streams on a worker that left may finish within this


class RemotePrefillFailed(PdserveError):
    code = "remote_prefill_failed"


class _Stubs:
    """One channel per worker address, closed when the worker leaves."""

    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._closing: set[asyncio.Task[None]] = set()

    def channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = gu.insecure_channel(address)
        return ch

    def decode(self, w: WorkerInfo) -> decode_pb2_grpc.DecodeWorkerStub:
        return decode_pb2_grpc.DecodeWorkerStub(self.channel(w.grpc_address))

    def prefill(self, w: WorkerInfo) -> prefill_pb2_grpc.PrefillWorkerStub:
        return prefill_pb2_grpc.PrefillWorkerStub(self.channel(w.grpc_address))

    def drop(self, address: str, grace_s: float) -> None:
        """Stop handing out the channel; streams still on it (a draining worker finishing
        its requests) get ``grace_s`` before the channel closes."""
        ch = self._channels.pop(address, None)
        if ch is not None:
            task = asyncio.get_running_loop().create_task(ch.close(grace=grace_s))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        for address in list(self._channels):
            self.drop(address, grace_s=1.0)
        if self._closing:
            await asyncio.wait(self._closing, timeout=5)


class Router:
    def __init__(self, registry: WorkerRegistry, tokenizer: Tokenizer, *, model_name: str,
                 max_model_len: int, config: RouterConfig | None = None,
                 metrics_registry: CollectorRegistry | None = None, poll_s: float = 0.25):
        self.config = config or RouterConfig()
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.directory = WorkerDirectory(registry, poll_s=poll_s)
        self._stubs = _Stubs()
        self._placements: dict[str, str] = {}  # request id -> decode worker id
        self._watch: asyncio.Task[None] | None = None
        self.metrics_registry = metrics_registry or CollectorRegistry()
        self.decisions = Counter("pdserve_router_decisions_total",
                                 "Routing decisions by route and reason", ["route", "reason"],
                                 registry=self.metrics_registry)
        self.fallbacks = Counter("pdserve_router_fallbacks_total",
                                 "Remote prefills that failed and were redone locally",
                                 ["cause"], registry=self.metrics_registry)
        self.retries = Counter("pdserve_router_decode_retries_total",
                               "Requests moved to another decode worker before any token",
                               registry=self.metrics_registry)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        await self.directory.start()
        self._watch = asyncio.create_task(self._follow_workers())

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        await self.directory.close()
        await self._stubs.close()

    async def __aenter__(self) -> Router:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _follow_workers(self) -> None:
        async for event in self.directory.events():
            if event.kind == "removed":
                log.info("worker_left", worker_id=event.worker.worker_id, role=event.worker.role)
                self._stubs.drop(event.worker.grpc_address, self.config.drain_grace_s)
            elif event.kind == "added":
                log.info("worker_joined", worker_id=event.worker.worker_id,
                         role=event.worker.role)

    def workers(self, role: str) -> list[WorkerInfo]:
        return [w for w in self.directory.snapshot().values() if w.role == role]

    def ready(self) -> tuple[bool, str]:
        if not self.workers("decode"):
            return False, "no decode worker is registered"
        return True, "ok"

    # ------------------------------------------------------------------ placement

    async def _cached(self, w: WorkerInfo, ids: tuple[int, ...]) -> int:
        try:
            resp = await self._stubs.decode(w).CachedPrefix(
                decode_pb2.CachedPrefixRequest(token_ids=ids),
                timeout=self.config.cached_prefix_timeout_s)
            return int(resp.num_cached_tokens)
        except grpc.aio.AioRpcError:
            return 0

    async def place(self, req: GenerateRequest, exclude: frozenset[str] = frozenset()
                    ) -> tuple[WorkerInfo, WorkerInfo | None, Decision]:
        decoders = [w for w in self.workers("decode") if w.worker_id not in exclude]
        if not decoders:
            raise CapacityError("no decode worker is available", code="no_decode_worker")
        ids = req.prompt_token_ids
        cached = await asyncio.gather(*(self._cached(w, ids) for w in decoders))
        cands = [DecodeCandidate(w.worker_id, c, w.load.get("running", 0),
                                 w.load.get("waiting", 0) + w.load.get("awaiting_kv", 0),
                                 w.load.get("free_blocks", 0), w.load.get("total_blocks", 0))
                 for w, c in zip(decoders, cached, strict=True)]
        best = choose_decode(cands, len(ids), self.config.policy)
        decode = next(w for w in decoders if w.worker_id == best.worker_id)
        prefills = self.workers("prefill")
        prefill = min(prefills, key=lambda w: (w.load.get("queued_tokens", 0),
                                               w.load.get("running", 0))) if prefills else None
        backlog = None if prefill is None else prefill.load.get("queued_tokens", 0)
        decision = decide_route(len(ids), best.cached_tokens, req.latency_class, backlog,
                                self.config.policy)
        return decode, prefill, decision

    # ------------------------------------------------------------------ generation

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenEvent]:
        """Stream a request's tokens. Closing the iterator cancels it on every worker."""
        started = time.monotonic()
        tried: set[str] = set()
        for attempt in range(self.config.max_decode_attempts):
            decode, prefill, decision = await self.place(req, frozenset(tried))
            tried.add(decode.worker_id)
            self.decisions.labels(decision.route.value, decision.reason).inc()
            log.info("route_decision", request_id=req.request_id, route=decision.route.value,
                     reason=decision.reason, uncached_tokens=decision.uncached_tokens,
                     prompt_tokens=len(req.prompt_token_ids), decode=decode.worker_id,
                     prefill=prefill.worker_id if prefill else None,
                     latency_class=req.latency_class.value)
            self._placements[req.request_id] = decode.worker_id
            emitted = False
            try:
                timings: dict[str, float] = {}
                route = decision.route
                if route is Route.REMOTE and prefill is not None:
                    try:
                        async with contextlib.aclosing(
                                self._remote(req, decode, prefill, timings)) as events:
                            async for ev in events:
                                emitted = True
                                yield self._final(ev, route, timings, started, decode, prefill)
                        return
                    except RemotePrefillFailed as exc:
                        if emitted:
                            raise
                        self.fallbacks.labels(exc.code).inc()
                        log.warning("remote_prefill_fallback", request_id=req.request_id,
                                    error=exc.message)
                        route = Route.FALLBACK
                async with contextlib.aclosing(self._local(req, decode)) as events:
                    async for ev in events:
                        emitted = True
                        yield self._final(ev, route, timings, started, decode,
                                          prefill if route is Route.FALLBACK else None)
                return
            except CapacityError:
                # The decode worker went away before producing anything: try another one.
                if emitted or attempt + 1 >= self.config.max_decode_attempts:
                    raise
                self.retries.inc()
            finally:
                self._placements.pop(req.request_id, None)

    @staticmethod
    def _final(ev: TokenEvent, route: Route, timings: dict[str, float], started: float,
               decode: WorkerInfo, prefill: WorkerInfo | None) -> TokenEvent:
        """Tag events with where they ran; the last one also gets the stage timings."""
        extra: dict[str, object] = {
            "route": route.value, "decode_worker": decode.worker_id,
            "prefill_worker": prefill.worker_id if prefill else None}
        if ev.finished:
            total = dict(timings)
            total["total_ms"] = (time.monotonic() - started) * 1000
            extra["timings_ms"] = total
        return dataclasses.replace(ev, **extra)  # type: ignore[arg-type]

    async def _stream(self, call: grpc.aio.UnaryStreamCall, first_timeout: float
                      ) -> AsyncIterator[TokenEvent]:
        """TokenEvents from a decode stream; every wait bounded; cancels the call on exit."""
        try:
            timeout = first_timeout
            while True:
                try:
                    chunk = await asyncio.wait_for(call.read(), timeout)
                except TimeoutError:
                    raise PdserveError(f"decode worker sent nothing for {timeout:.0f}s",
                                       code="decode_timeout") from None
                if chunk is grpc.aio.EOF:
                    raise CapacityError("decode stream ended without a final token",
                                        code="worker_unavailable")
                ev = gu.token_event_from_chunk(chunk)
                yield ev
                if ev.finished:
                    return
                timeout = self.config.token_timeout_s
        except grpc.aio.AioRpcError as exc:
            raise gu.error_from_rpc(exc) from None
        finally:
            call.cancel()

    async def _local(self, req: GenerateRequest, decode: WorkerInfo) -> AsyncIterator[TokenEvent]:
        stub = self._stubs.decode(decode)
        call = stub.Generate(decode_pb2.DecodeGenerateRequest(**gu.request_fields(req)),
                             metadata=gu.request_id_metadata(req.request_id))
        async with contextlib.aclosing(
                self._stream(call, self.config.first_token_timeout_s)) as events:
            async for ev in events:
                yield ev

    async def _remote(self, req: GenerateRequest, decode: WorkerInfo, prefill: WorkerInfo,
                      timings: dict[str, float]) -> AsyncIterator[TokenEvent]:
        cfg = self.config
        md = gu.request_id_metadata(req.request_id)
        dstub = self._stubs.decode(decode)
        t0 = time.monotonic()
        try:
            alloc = await dstub.AllocateRemote(
                decode_pb2.AllocateRequest(**gu.request_fields(req),
                                           lease_ms=int(cfg.prefill_timeout_s * 1000)),
                timeout=cfg.allocate_timeout_s, metadata=md)
        except grpc.aio.AioRpcError as exc:
            err = gu.error_from_rpc(exc)
            if isinstance(err, CapacityError):
                raise RemotePrefillFailed(f"decode allocation failed: {err}",
                                          code="allocate_failed") from None
            raise err from None
        timings["decode_allocate_ms"] = (time.monotonic() - t0) * 1000
        # Open the decode stream first: it starts decoding the moment the KV lands, taking the
        # first token from the transfer's completion notice (no extra hop through us).
        call = dstub.GenerateRemote(
            decode_pb2.RemoteGenerateRequest(
                request_id=req.request_id, transfer_id=alloc.transfer_id,
                transfer_timeout_ms=int((cfg.prefill_timeout_s + cfg.transfer_timeout_s) * 1000)),
            metadata=md)
        prefill_req = prefill_pb2.PrefillRequest(
            **gu.request_fields(req),
            destination=prefill_pb2.KVDestination(
                descriptor_id=alloc.descriptor_id, block_ids=alloc.block_ids,
                num_cached_tokens=alloc.num_cached_tokens, transfer_id=alloc.transfer_id),
            deadline_ms=int(cfg.prefill_timeout_s * 1000))
        pstub = self._stubs.prefill(prefill)
        async def call_prefill() -> prefill_pb2.PrefillResponse:
            return await pstub.Prefill(prefill_req, timeout=cfg.prefill_timeout_s, metadata=md)

        prefill_task = asyncio.create_task(call_prefill())
        stream = self._stream(call, cfg.prefill_timeout_s + cfg.transfer_timeout_s)
        first_task: asyncio.Task[TokenEvent] = asyncio.create_task(anext(stream))  # type: ignore[arg-type]
        try:
            await asyncio.wait({prefill_task, first_task}, return_when=asyncio.FIRST_COMPLETED)
            if not first_task.done() and prefill_task.exception() is not None:
                raise RemotePrefillFailed(f"prefill worker {prefill.worker_id} failed: "
                                          f"{_describe(prefill_task.exception())}",
                                          code="prefill_failed")
            try:
                first = await first_task
            except (PdserveError, KVTransferError) as exc:
                raise RemotePrefillFailed(f"KV never arrived: {exc}",
                                          code="transfer_failed") from None
            if prefill_task.done() and prefill_task.exception() is None:
                _record(timings, prefill_task.result(), t0)
            timings["ttft_ms"] = (time.monotonic() - t0) * 1000
            yield first
            if first.finished:
                return
            async for ev in stream:
                if ev.finished and prefill_task.done() and not prefill_task.cancelled() \
                        and prefill_task.exception() is None and "prefill_compute_ms" not in \
                        timings:
                    _record(timings, prefill_task.result(), t0)
                yield ev
        except BaseException:
            call.cancel()
            if not first_task.done():
                first_task.cancel()
            prefill_task.cancel()
            # Make sure the decode worker fences the transfer and frees the blocks.
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
                await asyncio.shield(dstub.Abort(common_pb2.AbortRequest(
                    request_id=req.request_id), timeout=5.0, metadata=md))
            raise
        finally:
            if not first_task.done():
                first_task.cancel()
                with contextlib.suppress(BaseException):
                    await first_task  # the stream must not be running when we close it
            await stream.aclose()

    async def abort(self, request_id: str) -> bool:
        worker_id = self._placements.get(request_id)
        w = self.directory.get(worker_id) if worker_id else None
        if w is None:
            return False
        try:
            resp = await self._stubs.decode(w).Abort(
                common_pb2.AbortRequest(request_id=request_id), timeout=5.0)
        except grpc.aio.AioRpcError as exc:
            raise gu.error_from_rpc(exc) from None
        return bool(resp.found)


def _describe(exc: BaseException | None) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return repr(exc)


def _record(timings: dict[str, float], resp: prefill_pb2.PrefillResponse, t0: float) -> None:
    timings["prefill_queued_ms"] = resp.timings.queued_ms
    timings["prefill_compute_ms"] = resp.timings.prefill_compute_ms
    timings["kv_transfer_ms"] = resp.timings.kv_transfer_ms
    timings["kv_bytes"] = float(resp.bytes_transferred)


__all__ = ["FinishReason", "Router", "RouterConfig"]

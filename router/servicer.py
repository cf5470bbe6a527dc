"""gRPC adapter for the Router: text / token ids / chat in, streamed responses out.

Requests are validated by the same rules as the REST gateway's (`engine.types`: request id,
sampling limits, prompt plus max_tokens within the context); every client mistake is
INVALID_ARGUMENT. Tokenizing runs on a worker thread, so a long prompt never stalls the event
loop that serves the gateway, the health service and every other stream.

Each caller is the tenant of its API key (`pdserve.tenants`; the interceptor has already
refused a wrong key): its `request_id` is only its own label (the router sees the key's
namespaced id, responses echo the label), `Abort` finds only its own requests, its requests
in flight are bounded (RESOURCE_EXHAUSTED, code ``quota_exceeded``) and its latency class
capped (downgraded) by its key's policy.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from typing import Protocol

import grpc

from pdserve.errors import InvalidRequestError
from pdserve.rpc import convert
from pdserve.rpc.auth import AUTHORIZATION_KEY
from pdserve.rpc.metadata import metadata_value
from pdserve.tenants import Lease, Tenant, Tenants
from pdserve.types import GenerateRequest, TokenEvent, check_request_id, fit_max_tokens
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from router.router import Resumed, Router
from router.timings import OWN

# Call metadata: the compiled data plane hands a request back with this token.
RESUME_KEY = "x-pdserve-resume"
_ROUTES = {"local": common_pb2.PREFILL_ROUTE_LOCAL, "remote": common_pb2.PREFILL_ROUTE_REMOTE,
           "fallback": common_pb2.PREFILL_ROUTE_FALLBACK}


class Resumes(Protocol):
    """Requests the compiled data plane hands back to this servicer (router.dataplane)."""

    def claim(self, token: str) -> Handback | None: ...


@dataclasses.dataclass(frozen=True)
class Handback:
    """A request the compiled data plane started and hands to the servicer to go on with
    (its decode worker failed it): its id as the router and the client know it, its tenant's
    admission, and where it got to (`router.router.Resumed`)."""

    request: GenerateRequest
    label: str
    lease: Lease
    resumed: Resumed


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, router: Router, tenants: Tenants | None = None,
                 resumes: Resumes | None = None):
        self.router = router
        self.tenants = tenants if tenants is not None else Tenants()
        self.resumes = resumes

    async def _tenant(self, context: grpc.aio.ServicerContext) -> Tenant:
        _, _, token = (metadata_value(context.invocation_metadata(), AUTHORIZATION_KEY)
                       or "").partition(" ")
        tenant = self.tenants.identify(token.strip())
        if tenant is None:  # only if the server runs without the API key interceptor
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "incorrect API key provided")
        assert tenant is not None
        return tenant

    def _prompt(self, request: router_pb2.GenerateRequest) -> list[int]:
        """Text or chat tokenized (token ids never come here: `_request` reads them)."""
        tok = self.router.tokenizer
        which = request.WhichOneof("input")
        if which == "text":
            return tok.encode(request.text)
        if which == "chat":
            return tok.apply_chat_template(
                [{"role": m.role, "content": m.content} for m in request.chat.messages])
        raise InvalidRequestError("request has no input (text, token_ids or chat)",
                                  param="input")

    async def _request(self, request: router_pb2.GenerateRequest, label: str,
                       tenant: Tenant) -> GenerateRequest:
        if request.WhichOneof("input") == "token_ids":
            return self.token_request(request, label, tenant)
        return await self.tokenized_request(request, label, tenant)

    def token_request(self, request: router_pb2.GenerateRequest, label: str,
                      tenant: Tenant, ids: tuple[int, ...] | None = None) -> GenerateRequest:
        """The request of a call whose prompt is token ids (nothing to tokenize: no await);
        `ids`: those ids, read already (the compiled data plane's), not from `request`."""
        has_sampling = request.HasField("sampling")
        sampling = convert.sampling_from_proto(request.sampling if has_sampling else None)
        latency_class = tenant.latency_class(convert.latency_from_proto(request.latency_class))
        # Token ids are only copied (~35 us for 1,500): a thread hop would cost more than
        # that and wake the loop through its self-pipe. (Through numpy the copy takes half as
        # long in a loop, but longer on a request's first step, which runs cold:
        # docs/bench/router_harness_spr/README.md.) Ids keep the field they came in, for the
        # worker's message (`prompt_wire`).
        wire = None
        if ids is None:
            ids = tuple(request.token_ids.ids)
            wire = (ids, request.token_ids.ids)
        requested = (request.sampling.max_tokens
                     if has_sampling and request.sampling.HasField("max_tokens") else None)
        max_tokens = fit_max_tokens(len(ids), requested, self.router.max_model_len,
                                    default=sampling.max_tokens, param="token_ids")
        if max_tokens != sampling.max_tokens:  # else no second validation of the same
            sampling = dataclasses.replace(sampling, max_tokens=max_tokens)
        return GenerateRequest(tenant.request_id(label), ids, sampling, latency_class,
                               prompt_wire=wire)

    async def tokenized_request(self, request: router_pb2.GenerateRequest, label: str,
                                tenant: Tenant) -> GenerateRequest:
        """The request of a call whose prompt is text or chat, tokenized off the loop."""
        # Everything cheap first, so an invalid request is refused before it is tokenized.
        has_sampling = request.HasField("sampling")
        sampling = convert.sampling_from_proto(request.sampling if has_sampling else None)
        latency_class = tenant.latency_class(convert.latency_from_proto(request.latency_class))
        # Text and chat are tokenized off the loop.
        which = request.WhichOneof("input")
        ids = tuple(await asyncio.to_thread(self._prompt, request))
        requested = (request.sampling.max_tokens
                     if has_sampling and request.sampling.HasField("max_tokens") else None)
        max_tokens = fit_max_tokens(len(ids), requested, self.router.max_model_len,
                                    default=sampling.max_tokens,
                                    param=which or "input")
        if max_tokens != sampling.max_tokens:  # else no second validation of the same
            sampling = dataclasses.replace(sampling, max_tokens=max_tokens)
        return GenerateRequest(tenant.request_id(label), ids, sampling, latency_class)

    async def Generate(self, request: router_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[router_pb2.GenerateResponse]:
        own = OWN.get()
        tenant = await self._tenant(context)
        handback = self._handback(context, tenant)
        if handback is not None:  # a stream the compiled data plane began
            with handback.lease:
                async for ev in self.router.generate(handback.request, handback.resumed):
                    yield _response(request, handback.label, ev)
            return
        label = check_request_id(request.request_id or f"req-{uuid.uuid4().hex}")
        with self.tenants.admit(tenant):  # held until the stream ends, however it ends
            req = await self._request(request, label, tenant)
            async for ev in self.router.generate(req):
                resp = _response(request, label, ev)
                if own is None:
                    yield resp
                    continue
                # The first response, handed to grpc: it writes it to the socket as it takes
                # it (`OwnTime`); the time is recorded once it has.
                parts = own.parts(time.perf_counter()) if ev.route == "local" else None
                own = None
                yield resp
                if parts:
                    self._overhead(*parts)

    def _handback(self, context: grpc.aio.ServicerContext, tenant: Tenant) -> Handback | None:
        """The request the compiled data plane hands back with this call (its resume token
        in the call's metadata; router.dataplane), or None for an ordinary call. Only the
        tenant whose request it is can claim it."""
        token = metadata_value(context.invocation_metadata(), RESUME_KEY)
        if token is None:
            return None
        handback = self.resumes.claim(token) if self.resumes is not None else None
        if handback is None or tenant.request_id(handback.label) != handback.request.request_id:
            raise InvalidRequestError(f"unknown {RESUME_KEY} token", param=RESUME_KEY)
        return handback

    def _overhead(self, into: float, out: float) -> None:
        parts = self.router.metrics.overhead_parts
        parts[0].observe(into)
        parts[1].observe(out)
        parts[2].observe(into + out)

    async def Abort(self, request: common_pb2.AbortRequest,
                    context: grpc.aio.ServicerContext) -> common_pb2.AbortResponse:
        """Abort the caller's own request `request_id`; another key's is "not found"."""
        tenant = await self._tenant(context)
        internal = tenant.request_id(check_request_id(request.request_id))
        return common_pb2.AbortResponse(found=await self.router.abort(internal))


def _response(request: router_pb2.GenerateRequest, label: str,
              ev: TokenEvent) -> router_pb2.GenerateResponse:
    """One streamed event as the client sees it: with its own request id (`label`)."""
    resp = router_pb2.GenerateResponse(
        request_id=label, text=ev.text,
        finish_reason=convert.finish_reason_to_proto(ev.finish_reason),
        error=ev.error or "",
        usage=router_pb2.Usage(prompt_tokens=ev.num_prompt_tokens,
                               completion_tokens=ev.num_output_tokens,
                               cached_tokens=ev.num_cached_tokens))
    if ev.token_id is not None:
        resp.token_ids.append(ev.token_id)
        if ev.logprob is not None:
            resp.logprobs.append(convert.logprob_to_proto(ev.logprob))
    if ev.route:
        resp.route = _ROUTES[ev.route]
    resp.decode_worker = ev.decode_worker or ""
    resp.prefill_worker = ev.prefill_worker or ""
    if ev.timings is not None and request.return_timings:
        resp.timings.CopyFrom(convert.stage_timings_to_proto(ev.timings))
    return resp


def add_to_server(router: Router, server: grpc.aio.Server,
                  tenants: Tenants | None = None) -> RouterServicer:
    """Serve ``router`` as the pdserve.v1.Router API on ``server``; `tenants`: its callers
    (shared with the REST gateway, so one key's quota spans both APIs), by default open. Its
    `resumes` are the compiled data plane's, when that runs (router.dataplane)."""
    servicer = RouterServicer(router, tenants)
    router_pb2_grpc.add_RouterServicer_to_server(servicer, server)
    return servicer

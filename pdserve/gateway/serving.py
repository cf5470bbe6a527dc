"""Serving one completion or chat request: admit it under its key's quota, read and translate
its body (`gateway.translate`), run its generations on the backend under the request timeout
while watching the client, and answer with one response or a stream of chunks built by
`gateway.assemble`. Every failure is an OpenAI error with a meaningful status; a stream that
fails after its first token ends with an error event, then ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator

import structlog
from fastapi import Request, Response
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect

from pdserve.errors import CapacityError, InvalidRequestError, PdserveError
from pdserve.gateway.assemble import (
    Choice,
    finish_error,
    finish_reason,
    pdserve_info,
    sse_data,
    usage,
)
from pdserve.gateway.backend import GenerationBackend
from pdserve.gateway.body import parse_json_object, read_body
from pdserve.gateway.config import GatewayConfig
from pdserve.gateway.errors import APIError, from_pdserve, internal, timed_out
from pdserve.gateway.metrics import GatewayMetrics, Outcome, RequestTracker
from pdserve.gateway.middleware import request_id_of, tenant_of
from pdserve.gateway.protocol import ChatCompletionChunk, CompletionChunk, Usage
from pdserve.gateway.streaming import (
    ClientDisconnected,
    MergedStream,
    SSEResponse,
    aclose,
    next_event,
    race,
)
from pdserve.gateway.translate import (
    LATENCY_CLASS_HEADER,
    Kind,
    Prepared,
    Translator,
    latency_label,
    parse_latency_class,
)
from pdserve.tenants import Lease, Tenant, Tenants
from pdserve.types import TokenEvent

log = structlog.get_logger(__name__)

TIMINGS_HEADER = "X-Pdserve-Timings"


class Serving:
    """The generation routes of one gateway."""

    def __init__(self, backend: GenerationBackend, config: GatewayConfig,
                 metrics: GatewayMetrics, tenants: Tenants, translator: Translator):
        self.backend = backend
        self.config = config
        self.metrics = metrics
        self.tenants = tenants
        self.translator = translator

    async def generate(self, request: Request, kind: Kind) -> Response:
        """Serve one request under its key's quota: the lease is held until the response
        (a stream: its last byte, or the client gone) is done."""
        tenant = tenant_of(request.scope)
        try:
            lease = self.tenants.admit(tenant)
        except PdserveError as exc:
            return self._reject(exc, "unknown", {})
        try:
            response = await self._serve(request, kind, tenant, lease)
        except BaseException:
            lease.release()
            raise
        if not isinstance(response, SSEResponse):
            lease.release()
        return response

    async def _serve(self, request: Request, kind: Kind, tenant: Tenant,
                     lease: Lease) -> Response:
        arrived = time.monotonic()
        deadline = asyncio.get_running_loop().time() + self.config.request_timeout_s
        headers: dict[str, str] = {}
        label = "unknown"
        try:
            header_class = parse_latency_class(request.headers.get(LATENCY_CLASS_HEADER))
            if header_class is not None:
                label = header_class.value
            body = parse_json_object(await read_body(request, self.config.max_body_bytes),
                                     self.config.max_json_depth)
            if header_class is None:
                label = latency_label(body.get("latency_class"))
            prep = await self.translator.prepare(kind, body, request_id_of(request.scope),
                                                 header_class, tenant)
        except (APIError, PdserveError) as exc:
            return self._reject(exc, label, headers)
        except ClientDisconnect:  # gone while sending the body
            return Response(status_code=499)
        lc = prep.gen.latency_class
        headers[LATENCY_CLASS_HEADER] = lc.value
        want_timings = request.headers.get(TIMINGS_HEADER, "").strip().lower() in (
            "1", "true", "yes")
        tracker = self.metrics.track(lc.value, arrived)
        try:
            events: AsyncIterator[TokenEvent]
            if len(prep.gens) == 1:
                events = self.backend.generate(prep.gen)
            else:
                events = MergedStream([
                    [(g.request_id, self.backend.generate(g))
                     for g in prep.gens[i : i + prep.best_of]]
                    for i in range(0, len(prep.gens), prep.best_of)])
        except Exception as exc:  # a backend whose generate() is not itself a generator
            return self._failed(exc, tracker, headers)

        if not prep.stream:
            try:
                collect = _collect(events, prep, tracker, self.config.retry_after_s)
                choices = await race(request.receive, collect, deadline)
            except BaseException as exc:
                await aclose(events)
                return self._failed(exc, tracker, headers)
            await aclose(events)
            tracker.finish("success")
            out = prep.builder.response(_best(prep, choices), _usage(prep, choices))
            if want_timings:
                last = choices[0].last
                assert last is not None  # _collect returns once every choice has finished
                out.pdserve = info = pdserve_info(last)
                headers[TIMINGS_HEADER] = json.dumps(info.body(), separators=(",", ":"))
            return JSONResponse(out.body(), headers=headers)

        # Wait for the first event before sending headers, so that a request the backend
        # refuses (no capacity, prompt too long) still gets a proper HTTP status.
        try:
            first = await race(request.receive, next_event(events), deadline)
            if first.finished and (err := finish_error(first, self.config.retry_after_s)):
                raise err
        except BaseException as exc:
            await aclose(events)
            return self._failed(exc, tracker, headers)

        async def cleanup() -> None:
            try:
                await aclose(events)
            finally:
                lease.release()
            tracker.finish("aborted")  # no-op if the stream already recorded its outcome

        body_iter = self._stream_body(prep, first, events, tracker, deadline, want_timings)
        return SSEResponse(body_iter, cleanup, headers)

    def _reject(self, exc: APIError | PdserveError, label: str,
                headers: dict[str, str]) -> JSONResponse:
        err = exc if isinstance(exc, APIError) else from_pdserve(
            exc, retry_after_s=self.config.retry_after_s)
        self.metrics.rejected(label)
        log.info("request rejected", status=err.status, code=err.code, param=err.param)
        return err.response(headers)

    def _failed(self, exc: BaseException, tracker: RequestTracker,
                headers: dict[str, str]) -> Response:
        """Map a failure before any response byte was sent; re-raises cancellation."""
        outcome: Outcome = "error"
        if isinstance(exc, asyncio.CancelledError):
            tracker.finish("aborted")
            raise exc
        if isinstance(exc, ClientDisconnected):
            tracker.finish("aborted")
            log.info("client disconnected")
            return Response(status_code=499)
        if isinstance(exc, APIError):
            err = exc
        elif isinstance(exc, TimeoutError):
            err = timed_out(self.config.request_timeout_s)
        elif isinstance(exc, PdserveError):
            err = from_pdserve(exc, retry_after_s=self.config.retry_after_s)
            if isinstance(exc, InvalidRequestError | CapacityError):
                outcome = "rejected"
        elif isinstance(exc, StopAsyncIteration):
            err = internal("the backend ended the stream without a final event")
        elif isinstance(exc, Exception):
            log.error("generation failed", exc_info=exc)
            err = internal()
        else:
            raise exc
        tracker.finish(outcome)
        log.info("request failed", status=err.status, code=err.code)
        return err.response(headers)

    async def _stream_body(self, prep: Prepared, first: TokenEvent,
                           events: AsyncIterator[TokenEvent], tracker: RequestTracker,
                           deadline: float, want_timings: bool) -> AsyncGenerator[bytes, None]:
        builder = prep.builder
        outcome: Outcome = "aborted"
        index_of = prep.index_of()
        lasts: dict[int, TokenEvent] = {}
        try:
            for opening in builder.opening_chunks():
                if prep.continuous_usage:
                    opening.usage = _usage(prep, lasts)
                yield sse_data(opening)
            for k in range(len(prep.gens)):
                if prep.echo_for(k):
                    yield sse_data(builder.chunk(prep.echo_for(k), [], None, k))
            ev = first
            while True:
                tracker.on_event(ev)
                k = index_of.get(ev.request_id, 0)
                lasts[k] = ev
                lps = [ev.logprob] if ev.logprob is not None and builder.logprobs else []
                chunk: CompletionChunk | ChatCompletionChunk | None = None
                if ev.finished:
                    err = finish_error(ev, self.config.retry_after_s)
                    if err is not None:
                        outcome = "error"
                        yield sse_data(err)
                        break
                    chunk = builder.chunk(ev.text, lps, finish_reason(ev), k)
                elif ev.text or lps:
                    chunk = builder.chunk(ev.text, lps, None, k)
                all_done = ev.finished and len(lasts) == len(prep.gens) and all(
                    e.finished for e in lasts.values())
                tail = [] if chunk is None else [chunk]
                if chunk is not None and prep.continuous_usage:
                    chunk.usage = _usage(prep, lasts)
                if all_done:
                    if prep.include_usage:
                        tail.append(builder.usage_chunk(_usage(prep, lasts)))
                    if want_timings and tail:
                        tail[-1].pdserve = pdserve_info(ev)
                for c in tail:
                    yield sse_data(c)
                if all_done:
                    outcome = "success"
                    break
                async with asyncio.timeout_at(deadline):
                    ev = await anext(events)
        except TimeoutError:
            outcome = "error"
            yield sse_data(timed_out(self.config.request_timeout_s))
        except PdserveError as exc:
            outcome = "error"
            yield sse_data(from_pdserve(exc, retry_after_s=self.config.retry_after_s))
        except StopAsyncIteration:
            outcome = "error"
            yield sse_data(internal("the backend ended the stream without a final event"))
        except Exception as exc:
            log.error("generation failed mid-stream", exc_info=exc)
            outcome = "error"
            yield sse_data(internal())
        finally:
            await aclose(events)
            tracker.finish(outcome)
        yield b"data: [DONE]\n\n"


async def _collect(events: AsyncIterator[TokenEvent], prep: Prepared, tracker: RequestTracker,
                   retry_after_s: int) -> list[Choice]:
    """Every generation of ``prep`` to its end, as choices in generation order."""
    index_of = prep.index_of()
    parts: list[list[str]] = [[prep.echo_for(k)] for k in range(len(prep.gens))]
    choices = [Choice(k, "") for k in range(len(prep.gens))]
    left = len(choices)
    async for ev in events:
        tracker.on_event(ev)
        k = index_of.get(ev.request_id, 0)
        parts[k].append(ev.text)
        if ev.logprob is not None:
            choices[k].logprobs.append(ev.logprob)
        if ev.finished:
            err = finish_error(ev, retry_after_s)
            if err is not None:
                raise err
            choices[k].text = "".join(parts[k])
            choices[k].finish_reason = finish_reason(ev)
            choices[k].last = ev
            left -= 1
            if not left:
                return choices
    raise StopAsyncIteration


def _best(prep: Prepared, choices: list[Choice]) -> list[Choice]:
    """The ``n`` choices returned per prompt: with best_of > n, those of highest cumulative
    logprob (ties: first generated); choice index = prompt index * n + rank."""
    if prep.best_of == prep.n:
        return choices
    out = []
    for p in range(0, len(choices), prep.best_of):
        group = choices[p : p + prep.best_of]
        ranked = sorted(group, key=lambda c: -sum(lp.logprob for lp in c.logprobs))[: prep.n]
        for rank, c in enumerate(ranked):
            c.index = p // prep.best_of * prep.n + rank
            out.append(c)
    return out


def _usage(prep: Prepared, lasts: list[Choice] | dict[int, TokenEvent]) -> Usage:
    """Usage so far: each prompt once, the completion tokens of every generation."""
    events = dict(enumerate(c.last for c in lasts)) if isinstance(lasts, list) else lasts
    prompts = []
    for p in range(0, len(prep.gens), prep.best_of):
        ev = next((e for k in range(p, p + prep.best_of) if (e := events.get(k)) is not None),
                  None)
        n = len(prep.gens[p].prompt_token_ids)
        prompts.append((ev.num_prompt_tokens or n, ev.num_cached_tokens) if ev else (n, 0))
    done = sum(e.num_output_tokens for e in events.values() if e is not None)
    return usage(prompts, done)

"""The OpenAI-compatible REST gateway over a `GenerationBackend`.

Routes: POST /v1/completions, POST /v1/chat/completions (streaming or not), GET /v1/models,
GET /health, GET /metrics, and GET /v1/pdserve/workers when the backend lists workers (admin
keys only when keys are set); the OpenAPI schema of exactly these at /openapi.json (browsable at
/docs and /redoc). Every error is an OpenAI error object with a meaningful status.

Each API key is a tenant (`pdserve.tenants`): the backend sees request ids namespaced by the
caller's key (responses echo the client's own), each key's requests in flight are bounded
and its latency class capped.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Literal, cast

import structlog
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from pdserve.engine.metrics import MODEL_LABEL, labelled_registry
from pdserve.gateway.backend import GenerationBackend, ListsWorkers
from pdserve.gateway.config import GatewayConfig
from pdserve.gateway.errors import (
    PERMISSION,
    SERVER_ERROR,
    APIError,
    bad_request,
    from_pdserve,
    internal,
    timed_out,
    unavailable,
)
from pdserve.gateway.metrics import GatewayMetrics, Outcome, RequestTracker
from pdserve.gateway.middleware import (
    METRICS_PATH,
    OPEN_PATHS,
    RequestContextMiddleware,
    request_id_of,
    tenant_of,
)
from pdserve.gateway.openai_format import (
    ChatFormat,
    Choice,
    CompletionFormat,
    ResponseFormat,
    merged_usage,
)
from pdserve.gateway.openapi import ROUTE_DOCS, install_openapi
from pdserve.gateway.schemas import (
    INT64_MAX,
    INT64_MIN,
    UNSUPPORTED_CHAT,
    UNSUPPORTED_COMPLETION,
    ChatCompletionRequest,
    CompletionRequest,
    OutputFormat,
    parse_json_object,
    validate,
)
from pdserve.gateway.streaming import (
    ClientDisconnected,
    MergedStream,
    SSEResponse,
    aclose,
    next_event,
    race,
)
from pdserve.tenants import Lease, Tenant, Tenants
from pdserve.types import (
    MAX_N,
    MAX_REQUEST_ID_LEN,
    CapacityError,
    FinishReason,
    GenerateRequest,
    InvalidRequestError,
    LatencyClass,
    PdserveError,
    SamplingParams,
    TokenEvent,
    fit_max_tokens,
)

__all__ = ["GatewayConfig", "create_app"]

log = structlog.get_logger(__name__)

LATENCY_CLASS_HEADER = "X-Latency-Class"
TIMINGS_HEADER = "X-Pdserve-Timings"
_MESSAGE_KEYS = frozenset({"role", "content", "name"})
_ROLES = ("prefill", "decode")
MAX_CHOICES = 4 * MAX_N  # generations per request: prompts x best_of

Kind = Literal["completion", "chat"]


def create_app(backend: GenerationBackend, config: GatewayConfig | None = None, *,
               tenants: Tenants | None = None) -> FastAPI:
    """Build the gateway app. Its metrics go into `backend.metrics_registry`, so build at
    most one app per backend (registering twice raises ValueError). `tenants`: the callers
    and their requests in flight, when shared with another API (the router's gRPC one);
    by default the config's keys, counted here alone."""
    config = config or GatewayConfig()
    if tenants is None:
        tenants = Tenants(config.api_keys, config.key_policies)
    gw = _Gateway(backend, config, GatewayMetrics(backend.metrics_registry), tenants)
    app = FastAPI(title="pdserve", docs_url="/docs", redoc_url="/redoc",
                  openapi_url="/openapi.json")
    open_paths = OPEN_PATHS if config.metrics_require_auth else OPEN_PATHS | {METRICS_PATH}
    app.add_middleware(RequestContextMiddleware, tenants=tenants, open_paths=open_paths)
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(APIError, _api_error)  # type: ignore[arg-type]
    routes: list[tuple[str, Callable[..., Any], str]] = [
        ("/v1/completions", gw.completions, "POST"),
        ("/v1/chat/completions", gw.chat_completions, "POST"),
        ("/v1/models", gw.models, "GET"),
        ("/v1/models/{model:path}", gw.model, "GET"),
        ("/health", gw.health, "GET"),
        ("/metrics", gw.metrics_page, "GET")]
    if isinstance(backend, ListsWorkers):  # else the route does not exist (404, not in the schema)
        routes.append(("/v1/pdserve/workers", gw.workers, "GET"))
    for path, endpoint, method in routes:
        app.add_api_route(path, endpoint, methods=[method], response_model=None,
                          **ROUTE_DOCS[path])
    install_openapi(app, config, max_model_len=backend.max_model_len,
                    vocab_size=backend.tokenizer.vocab_size)
    return app


@dataclass(frozen=True)
class _Prepared:
    """A validated request: ``best_of`` generations per prompt, prompts in order
    (generation ``k`` is sample ``k % best_of`` of prompt ``k // best_of``)."""

    gens: tuple[GenerateRequest, ...]
    fmt: ResponseFormat
    stream: bool
    include_usage: bool
    n: int = 1
    best_of: int = 1
    echo: tuple[str, ...] = ()  # per prompt: text put before each of its choices
    continuous_usage: bool = False
    hide_logprobs: bool = False  # logprobs asked for internally (best_of), not by the client

    @property
    def gen(self) -> GenerateRequest:
        return self.gens[0]

    def index_of(self) -> dict[str, int]:
        return {g.request_id: k for k, g in enumerate(self.gens)}

    def echo_for(self, k: int) -> str:
        return self.echo[k // self.best_of] if self.echo else ""


class _Gateway:
    def __init__(self, backend: GenerationBackend, config: GatewayConfig,
                 metrics: GatewayMetrics, tenants: Tenants):
        self.backend = backend
        self.tenants = tenants
        self.config = config
        self.metrics = metrics
        self.model_name = config.served_model_name or backend.model_name
        self.metrics_page_registry = labelled_registry(backend.metrics_registry,
                                                       **{MODEL_LABEL: self.model_name})
        self.created = int(time.time())

    # ------------------------------------------------------------------ simple routes

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self.created,
                "owned_by": "pdserve", "max_model_len": self.backend.max_model_len}

    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self._model_card()]}

    async def model(self, model: str) -> dict[str, Any]:
        self._check_model(model)
        return self._model_card()

    async def health(self) -> JSONResponse:
        ok, reason = self.backend.ready()
        if not ok:
            return APIError(503, reason, type=SERVER_ERROR, code="not_ready",
                            headers={"Retry-After": str(self.config.retry_after_s)}).response()
        return JSONResponse({"status": "ok"})

    async def workers(self, request: Request) -> dict[str, Any]:
        assert isinstance(self.backend, ListsWorkers)  # the route exists only then
        if not tenant_of(request.scope).policy.admin:  # internal addresses: operators only
            raise APIError(403, "listing workers needs an admin API key", type=PERMISSION,
                           code="permission_denied")
        found = [w for role in _ROLES for w in self.backend.workers(role)]
        return {"workers": [
            dataclasses.asdict(w) if dataclasses.is_dataclass(w) and not isinstance(w, type)
            else w for w in found]}

    async def metrics_page(self) -> Response:
        return Response(generate_latest(self.metrics_page_registry),
                        media_type=CONTENT_TYPE_LATEST)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completion")

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    # ------------------------------------------------------------------ generation

    async def _generate(self, request: Request, kind: Kind) -> Response:
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
        latency_label = "unknown"
        try:
            header_class = _parse_latency_class(request.headers.get(LATENCY_CLASS_HEADER))
            if header_class is not None:
                latency_label = header_class.value
            body = parse_json_object(await _read_body(request, self.config.max_body_bytes),
                                     self.config.max_json_depth)
            if header_class is None:
                latency_label = _label_of(body.get("latency_class"))
            prep = await self._prepare(request, kind, body, header_class, tenant)
        except (APIError, PdserveError) as exc:
            return self._reject(exc, latency_label, headers)
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
            used = _usage(prep, choices)
            out = prep.fmt.response(_best(prep, choices), used)
            if want_timings:
                last = choices[0].last
                assert last is not None  # _collect returns once every choice has finished
                out["pdserve"] = info = _pdserve_info(last)
                headers[TIMINGS_HEADER] = json.dumps(info, separators=(",", ":"))
            return JSONResponse(out, headers=headers)

        # Wait for the first event before sending headers, so that a request the backend
        # refuses (no capacity, prompt too long) still gets a proper HTTP status.
        try:
            first = await race(request.receive, next_event(events), deadline)
            if first.finished and (err := _finish_error(first, self.config.retry_after_s)):
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

    def _reject(self, exc: APIError | PdserveError, latency_label: str,
                headers: dict[str, str]) -> JSONResponse:
        err = exc if isinstance(exc, APIError) else from_pdserve(
            exc, retry_after_s=self.config.retry_after_s)
        self.metrics.rejected(latency_label)
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

    async def _stream_body(self, prep: _Prepared, first: TokenEvent,
                           events: AsyncIterator[TokenEvent], tracker: RequestTracker,
                           deadline: float, want_timings: bool) -> AsyncGenerator[bytes, None]:
        fmt = prep.fmt
        outcome: Outcome = "aborted"
        index_of = prep.index_of()
        lasts: dict[int, TokenEvent] = {}
        try:
            for opening in fmt.opening_chunks():
                if prep.continuous_usage:
                    opening["usage"] = _usage(prep, lasts)
                yield _sse_data(opening)
            for k in range(len(prep.gens)):
                if prep.echo_for(k):
                    yield _sse_data(fmt.chunk(prep.echo_for(k), [], None, k))
            ev = first
            while True:
                tracker.on_event(ev)
                k = index_of.get(ev.request_id, 0)
                lasts[k] = ev
                lps = [ev.logprob] if ev.logprob is not None and fmt.logprobs else []
                chunk: dict[str, Any] | None = None
                if ev.finished:
                    err = _finish_error(ev, self.config.retry_after_s)
                    if err is not None:
                        outcome = "error"
                        yield _sse_data(err.body())
                        break
                    chunk = fmt.chunk(ev.text, lps, _finish_reason(ev), k)
                elif ev.text or lps:
                    chunk = fmt.chunk(ev.text, lps, None, k)
                all_done = ev.finished and len(lasts) == len(prep.gens) and all(
                    e.finished for e in lasts.values())
                tail = [] if chunk is None else [chunk]
                if chunk is not None and prep.continuous_usage:
                    chunk["usage"] = _usage(prep, lasts)
                if all_done:
                    if prep.include_usage:
                        tail.append(fmt.usage_chunk(_usage(prep, lasts)))
                    if want_timings and tail:
                        tail[-1]["pdserve"] = _pdserve_info(ev)
                for c in tail:
                    yield _sse_data(c)
                if all_done:
                    outcome = "success"
                    break
                async with asyncio.timeout_at(deadline):
                    ev = await anext(events)
        except TimeoutError:
            outcome = "error"
            yield _sse_data(timed_out(self.config.request_timeout_s).body())
        except PdserveError as exc:
            outcome = "error"
            yield _sse_data(from_pdserve(exc, retry_after_s=self.config.retry_after_s).body())
        except StopAsyncIteration:
            outcome = "error"
            yield _sse_data(internal("the backend ended the stream without a final event").body())
        except Exception as exc:
            log.error("generation failed mid-stream", exc_info=exc)
            outcome = "error"
            yield _sse_data(internal().body())
        finally:
            await aclose(events)
            tracker.finish(outcome)
        yield b"data: [DONE]\n\n"

    # ------------------------------------------------------------------ request -> GenerateRequest

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name and \
                model not in self.config.model_aliases:
            shown = model if len(model) <= 100 else model[:100] + "..."
            raise APIError(404, f"the model '{shown}' does not exist; this server serves "
                           f"'{self.model_name}'", code="model_not_found", param="model")

    async def _prepare(self, request: Request, kind: Kind, body: dict[str, Any],
                       header_class: LatencyClass | None, tenant: Tenant) -> _Prepared:
        """Validate and tokenize. Tokenizing (and chat templating) runs on a worker thread:
        a megabyte prompt takes seconds, and the event loop serves every other request.
        The generations get the tenant's internal ids and at most its latency class."""
        req: CompletionRequest | ChatCompletionRequest
        if kind == "completion":
            req = validate(body, CompletionRequest, UNSUPPORTED_COMPLETION)
        else:
            req = validate(body, ChatCompletionRequest, UNSUPPORTED_CHAT)
        self._check_model(req.model)
        body_class = _parse_latency_class(req.latency_class)
        if header_class is not None and body_class is not None and header_class != body_class:
            raise bad_request(f"the {LATENCY_CLASS_HEADER} header ({header_class}) and the "
                              f"latency_class field ({body_class}) disagree",
                              param="latency_class", code="invalid_latency_class")
        latency_class = tenant.latency_class(header_class or body_class or LatencyClass.STANDARD)
        if req.stream_options is not None and not req.stream:
            raise bad_request("stream_options is only allowed when stream is true",
                              param="stream_options")
        logprobs: int | None
        echo = False
        if isinstance(req, CompletionRequest):
            prompt_param = "prompt"
            prompts = await asyncio.to_thread(self._prompts_ids, req.prompt)
            requested = req.max_tokens
            logprobs = req.logprobs
            best_of = req.n if req.best_of is None else req.best_of
            echo = req.echo
            if echo and logprobs is not None:
                raise bad_request("echo with logprobs (prompt logprobs) is not supported",
                                  param="echo", code="unsupported_parameter")
        else:
            prompt_param = "messages"
            ids = await asyncio.to_thread(self.backend.tokenizer.apply_chat_template,
                                          _chat_messages(req.messages))
            prompts = [(ids, "")]
            if (req.max_tokens is not None and req.max_completion_tokens is not None
                    and req.max_tokens != req.max_completion_tokens):
                raise bad_request("max_tokens and max_completion_tokens disagree; send one",
                                  param="max_completion_tokens")
            requested = req.max_completion_tokens or req.max_tokens
            if req.top_logprobs is not None and not req.logprobs:
                raise bad_request("top_logprobs requires logprobs to be true",
                                  param="top_logprobs")
            logprobs = (req.top_logprobs or 0) if req.logprobs else None
            best_of = req.n
        if best_of < req.n:
            raise bad_request(f"best_of ({best_of}) must be at least n ({req.n})",
                              param="best_of")
        if best_of > req.n and req.stream:
            raise bad_request("best_of > n cannot be streamed", param="best_of")
        if len(prompts) * best_of > MAX_CHOICES:
            raise bad_request(f"at most {MAX_CHOICES} generations per request (prompts x "
                              f"best_of), got {len(prompts) * best_of}", param="prompt")
        hide_logprobs = best_of > req.n and logprobs is None
        common = dict(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None or req.top_k == -1 else req.top_k,
            stop=(req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ()),
            ignore_eos=req.ignore_eos,
            logprobs=0 if hide_logprobs else logprobs,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty,
            logit_bias=self._logit_bias(req.logit_bias),
            min_p=req.min_p,
            min_tokens=req.min_tokens,
            stop_token_ids=tuple(req.stop_token_ids or ()),
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens,
            json_schema=_json_schema(req.response_format),
        )
        rid = request_id_of(request.scope)  # the client's label, echoed in the response
        internal = tenant.request_id(rid)
        total = len(prompts) * best_of
        gens = []
        for p, (ids, _) in enumerate(prompts):
            max_tokens = self._max_tokens(len(ids), requested, prompt_param)
            for j in range(best_of):
                seed = None if req.seed is None else _wrap_int64(req.seed + j)
                sampling = SamplingParams(max_tokens=max_tokens, seed=seed,
                                          **common)  # type: ignore[arg-type]
                child = internal if total == 1 else \
                    f"{internal[:MAX_REQUEST_ID_LEN - 8]}-{p * best_of + j}"
                gens.append(GenerateRequest(child, tuple(ids), sampling, latency_class))
        fmt_cls = CompletionFormat if kind == "completion" else ChatFormat
        fmt = fmt_cls(rid, self.model_name, int(time.time()), self.backend.tokenizer,
                      logprobs is not None, num_choices=len(prompts) * req.n)
        options = req.stream_options
        return _Prepared(tuple(gens), fmt, req.stream,
                         include_usage=options is not None and options.include_usage,
                         n=req.n, best_of=best_of,
                         echo=tuple(text for _, text in prompts) if echo else (),
                         continuous_usage=options is not None and options.continuous_usage_stats,
                         hide_logprobs=hide_logprobs)

    def _logit_bias(self, bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
        vocab = self.backend.tokenizer.vocab_size
        out = []
        for key, value in (bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                raise bad_request(f"logit_bias keys must be token ids, got {key[:32]!r}",
                                  param="logit_bias") from None
            if not 0 <= token < vocab:
                raise bad_request(f"logit_bias token id {token} is outside the vocabulary "
                                  f"[0, {vocab})", param="logit_bias")
            out.append((token, value))
        return tuple(out)

    def _prompts_ids(self, prompt: str | list[int] | list[str] | list[list[int]]) -> list[
            tuple[list[int], str]]:
        """Each prompt's token ids and text (the text only matters for echo)."""
        tok = self.backend.tokenizer
        if isinstance(prompt, str):
            return [(tok.encode(prompt), prompt)]
        # all(isinstance(...)) does not narrow the list's type: cast() says what it checked.
        if prompt and all(isinstance(p, str) for p in prompt):
            return [(tok.encode(p), p) for p in cast(list[str], prompt)]
        if prompt and all(isinstance(p, list) for p in prompt):
            return [self._token_prompt(p) for p in cast(list[list[int]], prompt)]
        return [self._token_prompt(cast(list[int], prompt))]

    def _token_prompt(self, ids: list[int]) -> tuple[list[int], str]:
        vocab = self.backend.tokenizer.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary [0, {vocab})",
                              param="prompt")
        return [int(t) for t in ids], self.backend.tokenizer.decode(ids)

    def _max_tokens(self, num_prompt: int, requested: int | None, param: str) -> int:
        return fit_max_tokens(num_prompt, requested, self.backend.max_model_len,
                              default=self.config.default_max_tokens, param=param)


# ---------------------------------------------------------------------- helpers


async def _read_body(request: Request, limit: int) -> bytes:
    too_large = APIError(413, f"the request body exceeds {limit} bytes",
                         code="request_too_large")
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise bad_request("invalid Content-Length header")
        if int(declared) > limit:
            raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def _label_of(body_class: Any) -> str:
    """Metrics label for a request rejected before its latency class was validated."""
    if body_class is None:
        return LatencyClass.STANDARD.value
    try:
        return LatencyClass(str(body_class).strip().lower()).value
    except ValueError:
        return "unknown"


def _parse_latency_class(value: str | None) -> LatencyClass | None:
    return None if value is None or not value.strip() else LatencyClass.parse(value)


def _chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI message variants -> plain {role, content} strings for the chat template."""
    out = []
    for i, msg in enumerate(messages):
        extra = sorted(set(msg) - _MESSAGE_KEYS)
        if extra:
            raise bad_request(f"messages[{i}].{extra[0]} is not supported by this server",
                              param="messages", code="unsupported_parameter")
        msg = {k: v for k, v in msg.items() if k != "name"}
        if msg.get("role") == "developer":  # OpenAI's newer name for the system role
            msg["role"] = "system"
        content = msg.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text"
                        and isinstance(part.get("text"), str)):
                    raise bad_request(f"messages[{i}].content: only text parts are supported",
                                      param="messages", code="unsupported_parameter")
                texts.append(part["text"])
            msg["content"] = "".join(texts)
        out.append(msg)
    return out


async def _collect(events: AsyncIterator[TokenEvent], prep: _Prepared, tracker: RequestTracker,
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
            err = _finish_error(ev, retry_after_s)
            if err is not None:
                raise err
            choices[k].text = "".join(parts[k])
            choices[k].finish_reason = _finish_reason(ev)
            choices[k].last = ev
            left -= 1
            if not left:
                return choices
    raise StopAsyncIteration


def _best(prep: _Prepared, choices: list[Choice]) -> list[Choice]:
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


def _usage(prep: _Prepared, lasts: list[Choice] | dict[int, TokenEvent]) -> dict[str, Any]:
    """Usage so far: each prompt once, the completion tokens of every generation."""
    events = dict(enumerate(c.last for c in lasts)) if isinstance(lasts, list) else lasts
    prompts = []
    for p in range(0, len(prep.gens), prep.best_of):
        ev = next((e for k in range(p, p + prep.best_of) if (e := events.get(k)) is not None),
                  None)
        n = len(prep.gens[p].prompt_token_ids)
        prompts.append((ev.num_prompt_tokens or n, ev.num_cached_tokens) if ev else (n, 0))
    done = sum(e.num_output_tokens for e in events.values() if e is not None)
    return merged_usage(prompts, done)


def _json_schema(fmt: OutputFormat | None) -> str | None:
    """response_format -> the JSON schema text the engine constrains the output to."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return '{"type": "object"}'
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise bad_request("response_format json_schema needs json_schema.schema",
                          param="response_format")
    return json.dumps(fmt.json_schema.schema_, separators=(",", ":"))


def _wrap_int64(v: int) -> int:
    return (v - INT64_MIN) % (INT64_MAX - INT64_MIN + 1) + INT64_MIN


def _finish_error(ev: TokenEvent, retry_after_s: int) -> APIError | None:
    if ev.finish_reason is FinishReason.ERROR:
        return internal(f"generation failed: {ev.error or 'engine error'}", "engine_error")
    if ev.finish_reason is FinishReason.ABORT:
        return unavailable("the server aborted the request", code="aborted",
                           retry_after_s=retry_after_s)
    return None


def _finish_reason(ev: TokenEvent) -> str:
    return "length" if ev.finish_reason is FinishReason.LENGTH else "stop"


def _pdserve_info(ev: TokenEvent) -> dict[str, Any]:
    return {"route": ev.route, "timings_ms": ev.timings_ms or {}}


def _sse_data(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return exc.response()


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    where = f"{request.method} {request.url.path}"
    if exc.status_code == 404:
        return APIError(404, f"no such route: {where}", code="not_found").response()
    if exc.status_code == 405:
        return APIError(405, f"method not allowed: {where}", code="method_not_allowed",
                        headers=dict(exc.headers or {})).response()
    return APIError(exc.status_code, str(exc.detail), code="http_error",
                    headers=dict(exc.headers or {})).response()


async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    loc = errors[0].get("loc", ()) if errors else ()
    param = str(loc[-1]) if loc else None
    msg = errors[0].get("msg", "invalid request") if errors else "invalid request"
    return bad_request(f"invalid value for {param}: {msg}", param=param).response()
